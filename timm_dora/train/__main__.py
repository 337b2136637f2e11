"""``python -m timm_dora.train`` (and ``torchrun ... -m timm_dora.train``): :func:`timm_dora.train.cli.main`."""
import sys

from .cli import main

sys.exit(main())
