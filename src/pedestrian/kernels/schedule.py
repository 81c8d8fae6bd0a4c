"""The fast path's schedule: every size at which a kernel changes how it runs, in one table.

Each number cites the measurement behind it (docs/kernels.md, docs/performance.md,
docs/performance-history.md, or the commit that set it); "not measured" says where none exists.
None of them changes a result's bits except where marked (the blocks of a fixed-order sum).

The Python-side thresholds are read as ``schedule.NAME`` when a kernel is called, so a test may
patch them here. The block sizes marked *compiled in* are read by numba when it compiles a kernel
and kept in its disk cache, which numba refreshes by the kernel's own source file only: after
editing one of them in a checkout, delete the caches (``find src -name "*.nb[ic]" -delete``).
"""

from __future__ import annotations

# --------------------------------------------------------------------- threads (kernels/jit.py)
#: a parallel kernel's job (by default its first argument's size) of fewer
#: elements runs its serial compilation: 2.2 against 4.3 µs for a layer norm of one 768-wide
#: row, one generated token (commit 8e4e0a5; docs/kernels.md, "one generated token")
SERIAL_BELOW = 1 << 12
#: from this many elements a parallel kernel runs on every thread, below it on one: a parallel
#: region costs ~3-5 µs to start and join (commit 8e4e0a5). The value itself: not measured
#: against others (row blocks of 2^15-2^16 elements measured 3-12 % worse than 2^18 for the
#: NumPy row kernels these replaced: docs/performance-history.md)
PARALLEL_MIN_ELEMENTS = 1 << 15

# ----------------------------------------------------------------- products (kernels/blas.py)
#: a 2-D product is shared over the threads from this many multiply-adds (m·k·n); below, one
#: BLAS call. Not measured (set with "one pool of threads", commit f64960b, docs/kernels.md)
PARALLEL_MIN_MACS = 1 << 18
#: rows, columns or shared-axis rows per band of a shared product at least. Not measured
MIN_PART_ROWS = 16
#: a transposed left operand whose rows lie this many bytes apart or more is copied, COPY_ROWS rows
#: at a time, before its row band's BLAS call; nearer, BLAS reads the view. SmolLM2-135M's shape, T
#: = 512, 2 threads: the tied logits' gradient Δ12ᵀ a11 (rows 196,608 bytes apart) 156 ms copied
#: against 213 ms read in place; the weight gradients' xᵀ (2,304-6,144 bytes) 1.96 against 2.25
#: and 5.46 against 6.58 ms read in place (docs/kernels.md, "Bands of the longer side")
COPY_MIN_STRIDE = 1 << 16
#: rows of such an operand copied at a time inside a row band (compiled in): gpt2's tied-logits
#: gradient no longer copies the whole (V, B·T) operand, peak RSS 2659 → 2562-2611 MiB (commit fffffcc)
COPY_ROWS = 1024
#: numbers of the split-k route's partial outputs at most (16 MiB of float32): the tied logits'
#: (V, d) at large batches take the row blocks, not 154 MB of scratch per thread (commit ca50603)
SPLIT_K_MAX_PARTIAL = 1 << 22
#: a column sum is shared over the threads from this many elements, in blocks of at least
#: COLSUM_MIN_COLUMNS columns. Not measured (commit f64960b)
COLSUM_PARALLEL_MIN = 1 << 15
COLSUM_MIN_COLUMNS = 64

# ----------------------------------------------------------- few tokens (linear, workspace)
#: a linear layer's input of at most this many elements (a few tokens while generating) is one
#: plain product, skipping the memory pool and the row blocks: the bookkeeping costs more than
#: one token's arithmetic (commit c614b2c; docs/kernels.md, "one generated token"); torch-backend
#: generation +5-7 % tokens/s (commit c7a3b19)
SMALL_ELEMENTS = 1 << 12
#: smaller arrays are not pooled: malloc's free lists serve them faster than the pool's
#: bookkeeping, and only large blocks go back to the OS (glibc's mmap threshold: 128 KiB and up).
#: The pool itself: char-small 87-88 against 66-67 ms a step without it (docs/kernels.md, "memory
#: pool"); this bound: commit c614b2c, not measured against others
MIN_POOLED_BYTES = 1 << 16
#: arrays pooled per shape at most (a caller keeping every step's logits must not make each later
#: request scan them all; gpt2-124M's backward has ~80 (B, T, d) arrays live at once). Not measured
MAX_PER_SHAPE = 256

# ------------------------------------------------------------- attention (attention*.py)
#: a KV-cache step of at most this many new tokens runs as one numba loop nest (products as
#: loops, not BLAS): 0.62-0.86 of the previous step's time at 1-3 new tokens, whole generation
#: 857-1,196 against 505-799 tokens/s (docs/kernels.md, "Attention on numba"); the bound 8 itself:
#: not measured
DECODE_MAX_T = 8
#: the shortest sequence run by the tiled attention, per backend (below it the full-matrix
#: attention is faster). NumPy: a whole step tiled ÷ full 0.98 at T = 256, 1.03-1.11 at 128
#: (docs/performance.md, "The crossover"; full / tiled at 4 × 256 10.7 / 9.8 ms, docs/kernels.md);
#: torch tensors, the kernel alone: 0.98 at 256, 0.78 at 512 (the switch put at 512, same place)
TILED_MIN_T = {"numpy": 256, "torch": 512}
#: ``(block_q, block_k)`` of one tile per backend: tiles from 64 × 128 to 256 × 512 within 10 %
#: of each other, 128 × 256 among the best for both directions (docs/performance.md, "Tiled
#: attention"); torch's 256 × 512 (all heads of a tile per batched call): not measured apart
TILED_BLOCKS = {"numpy": (128, 256), "torch": (256, 512)}

# ------------------------------------------------- fixed-order sums (compiled in; the bits)
#: rows per block of the norms' ``dw``, ``db`` partial sums: the blocks, and so the bits of
#: ``dw``, do not depend on the thread count (a choice of determinism; its speed: not measured)
NORM_BLOCK_ROWS = 32
#: logits summed in their own dtype before joining the row's float64 total: vectorised float32
#: additions, gpt2's 256 × 50257 logits 8.6 against 16.4 ms all in float64, the same sum to 2e-8
#: (docs/kernels.md, "cross-entropy"); the block length 512 itself: not measured against others
LOSS_SUM_BLOCK = 512
