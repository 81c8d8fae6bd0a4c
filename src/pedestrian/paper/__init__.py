"""What the paper does beside the model: check a hand-written backward against numbers."""
