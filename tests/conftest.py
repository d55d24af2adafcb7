"""Suite-wide settings. The reference platform's bits do not depend on the thread count (its
tests check that), but on a busy 2-core CI host many tiny fixed-shape GEMMs run several times
faster on one thread than on two contending ones.
"""
import torch

torch.set_num_threads(1)
