"""mindspore-ckpt (moved to formats/mindspore_ckpt/reader.py; split by responsibility next)."""

from .reader import *  # noqa: F401,F403
