"""Text: the corpus (``data.py``, the bundled Shakespeare in ``corpus/``), token files
(``tokens.py``) and the tokenizers (``tokenizer.py``: character-level and byte-level BPE).
"""
