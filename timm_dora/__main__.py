"""``python -m timm_dora``: the ``timm-dora`` command (:mod:`timm_dora.cli`)."""
import sys

from .cli import main

sys.exit(main())
