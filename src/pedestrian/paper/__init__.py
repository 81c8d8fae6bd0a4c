"""The paper on screen: its table of activations and FLOPs (``explain.py``), one attention head
step by step (``walkthrough.py``), the demo's model and measured properties (``demo.py``), the
pictures of attention and of one training step (``pictures.py``), the demo's gradient lines
(``gradients.py``), and the check of a hand-written backward of your own (``check.py``).
"""
