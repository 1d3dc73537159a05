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


def scratch_dir(prefix):
    """A temporary folder for checkpoints (gigabytes at real widths), removed when the process ends: at exit, and
    on SIGTERM (`timeout` stopping a run), which would otherwise leave it behind and fill the disk for the runs
    after it."""
    import atexit
    import shutil
    import signal
    import tempfile

    work = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, work, True)
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return work
