"""The path under the ``vcga`` process group (:mod:`vcga.process_group`, the public entry).

- :mod:`~vcga.pg.allreduce` -- ``all_reduce``: argument checks and the hot path;
- :mod:`~vcga.pg.collectives` -- the other collectives: argument checks, reductions, data movement
  (loaded at the first call of one);
- :mod:`~vcga.pg.dispatch` -- capability-aware dispatch: native, emulated or refused; its recipes
  and refusals :mod:`~vcga.pg.recipes` load at the first call the native fast path does not take;
- :mod:`~vcga.pg.p2p`, :mod:`~vcga.pg.monitored` -- point to point and ``monitored_barrier``
  (each loaded at a group's first call of it);
- :mod:`~vcga.pg.transport` -- what moves the bytes: one vendor's native group, or the bridge;
- :mod:`~vcga.pg.discovery` -- every rank of a new group learns what every other rank runs;
- :mod:`~vcga.pg.workqueue` -- one ordered queue of collectives per group, on its own thread;
- :mod:`~vcga.pg.debug` -- ``VCGA_DEBUG`` fingerprints;
- :mod:`~vcga.pg.comm` -- :func:`vcga.init` and the :class:`~vcga.pg.comm.Communicator`;
- :mod:`~vcga.pg.recorder` -- the flight recorder's ring and each thread's current call; its dump
  :mod:`~vcga.pg.frdump` and ``vcga trace``'s analysis :mod:`~vcga.pg.frtrace` load on use;
- :mod:`~vcga.pg.spans` -- torch profiler spans of the calls and their steps.

Internal: plugins import :mod:`vcga.process_group` and :mod:`vcga.pypg`, never this package.
"""
