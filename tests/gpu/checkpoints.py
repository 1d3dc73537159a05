"""A random checkpoint of a test config, in the format its architecture's
library loads: K3 through tests/gpu/make_k3_checkpoint.py (MXFP4 experts),
DeepSeek-V3 / Kimi K2 and Kimi Linear through tests/gpu/deepseek_v3_decode.py.
The one place the GPU harnesses (generate.py, soak.py) choose the maker."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def make_checkpoint(arch, config, seed, out):
    """arch: k3, deepseek_v3 or kimi_linear."""
    if arch == "k3":
        import make_k3_checkpoint

        make_k3_checkpoint.make(config, out, True, seed)
    else:
        import deepseek_v3_decode

        deepseek_v3_decode.ARCH = arch
        deepseek_v3_decode.make_checkpoint(config, seed, out)
