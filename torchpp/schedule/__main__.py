"""Entry point of ``python -m torchpp.schedule`` (see cli.py)."""
import sys

from torchpp.schedule.cli import main

sys.exit(main())
