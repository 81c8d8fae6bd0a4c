"""A layer module with a typo at the top level (a usage error for `pedestrian check`)."""

import numpy as np

SCALE = np.sqroot(2.0)
