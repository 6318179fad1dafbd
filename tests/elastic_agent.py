"""torchrun, with its workers forked from an interpreter that has imported what they import.

    python -u tests/elastic_agent.py <torchrun's options> script.py [script args]

The command line is torchrun's, read by torchrun's own code (``torch.distributed.run.parse_args``
and ``config_from_args``), and the launch is torchrun's: ``elastic_launch`` with its
LocalElasticAgent, the rendezvous (``--standalone``: c10d on a free port), the restarts, the
monitor interval, the environment each worker gets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``, ...). Only the start of a worker
differs: torchrun runs ``python -u script.py`` per worker and per attempt, a fresh interpreter
that imports torch, torch._dynamo (DDP's constructor) and vcga -- about 3.5 CPU-s each. Here this
interpreter imports them once, and torchrun's agent forks each worker from it
(``--start-method fork``), which runs the script with runpy as ``__main__`` (torchrun's
``--run-path``).

A forked worker starts as a fresh one would, where the script could tell:

- the signal handlers are those this interpreter started with: the agent's (which turn SIGTERM,
  SIGINT, SIGHUP and SIGQUIT into an exception, and are installed just before the fork) would keep
  a torn-down worker running Python code, where ``python script.py`` dies of the agent's SIGTERM;
- ``sys.argv`` is the script's; an exception it raises is printed on stderr (and ends the worker
  with status 1), ``sys.exit(None)`` ends it with status 0 (torch's own run-path wrapper accepts
  only ``sys.exit(0)`` and would leave the agent waiting for a return value), and at its end the
  threads it started that are not daemons are joined and its atexit hooks run, as at an
  interpreter's exit (a forked process ends in ``os._exit``).

The agent has started threads when it forks (the TCP store's server, the rendezvous' heartbeats):
a worker uses none of them -- it connects to the store as a client, as a fresh worker does.
tests/elastic_run.py starts this as one subprocess, as it starts torchrun.
"""

from __future__ import annotations

import atexit
import runpy
import signal
import sys
import threading
import uuid

# What a worker of examples/train_elastic.py imports before it trains (DDP's constructor imports
# torch._dynamo); a script that needs more imports it after the fork.
import torch
import torch._dynamo
import torch.distributed.checkpoint.state_dict
import torch.nn.parallel  # noqa: F401
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import elastic_launch

import vcga
import vcga.checkpoint
import vcga.errors
import vcga.testing.fault  # noqa: F401

# torchrun's agent installs its handlers for these (TORCHELASTIC_SIGNALS_TO_HANDLE) just before it forks
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_STARTUP_HANDLERS = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}


def run_worker(script: str, *argv: str) -> None:
    """One worker: ``script`` as ``__main__`` with ``argv``, in the forked process (the docstring)."""
    for sig, handler in _STARTUP_HANDLERS.items():
        signal.signal(sig, handler)
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is not None and e.code != 0:
            raise
    except BaseException:
        sys.excepthook(*sys.exc_info())
        raise
    finally:  # what an interpreter does at its exit, which a forked process ends without (os._exit)
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()


@record
def main(argv: list[str]) -> None:
    args = torchrun.parse_args(["--start-method", "fork", "--run-path", *argv])
    if args.standalone:  # as torch.distributed.run.run() resolves it
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, script_and_args = torchrun.config_from_args(args)
    elastic_launch(config, entrypoint=run_worker)(*script_and_args)


if __name__ == "__main__":
    main(sys.argv[1:])
