"""Training, read top to bottom as one run goes: :mod:`.settings` (what a run is asked to do, and
the merge of defaults, a TOML file and the flags; each setting declared once with :mod:`.specs`),
:mod:`.run` (:func:`train`: build or resume, then the loop), :mod:`.corpus` (its tokens),
:mod:`.job` (the :class:`~.loop.Trainer` built from the settings, and its failures explained:
shared with :mod:`.finetune`, the LoRA fine-tuning), :mod:`.loop` (the loop and its stop
decisions), :mod:`.step` (one step: accumulation, clipping, AdamW), :mod:`.optim` (AdamW, the
schedule), :mod:`.files` (the log, checkpoints and plots) and :mod:`.distributed` (several ranks).
"""

from .corpus import build_tokenizer, corpus_split, evaluate_tokens, prepare_data, split_tokens
from .files import RunFiles, gradient_record, plot_gradients, plot_loss_curve, read_log
from .run import TrainResult, train
from .settings import (DEFAULT_MODEL, PER_RUN_SETTINGS, RESUMABLE_SETTINGS, TrainSettings, per_run_flags,
                       read_config_file, settings_from_args)
from .step import TrainingError, estimate_loss, train_step

__all__ = ["TrainSettings", "DEFAULT_MODEL", "TrainResult", "TrainingError", "train", "train_step",
           "estimate_loss", "evaluate_tokens", "corpus_split", "prepare_data", "build_tokenizer", "split_tokens",
           "read_log", "plot_loss_curve", "gradient_record", "plot_gradients", "RunFiles",
           "RESUMABLE_SETTINGS", "PER_RUN_SETTINGS", "per_run_flags", "read_config_file",
           "settings_from_args"]
