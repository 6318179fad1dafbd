"""Which tests of torch's distributed_test.py run in ``make test``, and why the others do not.

Two passes (see runner.py):

- ``PASS_VCGA``: ``BACKEND=vcga``, the way a plugin backend joins the suite. Skip gates see
  "vcga"; tests gated on another backend's name skip.
- ``PASS_GLOO_GATES``: the skip gates see "gloo" while every group the tests create is a
  ``vcga`` group: the tests torch reserves for gloo by name (timeouts, coalesced all-reduce,
  futures, sparse all-reduce, batched p2p) run against ``vcga`` too.

The selection covers every collective, the async/future paths, subgroups, and DDP in its main
modes, in about half a minute; ``VCGA_TORCH_SUITE=full`` runs every test of both passes.
docs/torch-suite.md lists each test's outcome in a full run and the reason for every skip.
"""

from __future__ import annotations

PASS_VCGA: tuple[str, ...] = (
    # collectives, sync and async, whole group and subgroups, complex via torch's real views
    "test_all_reduce_sum",
    "test_all_reduce_product",
    "test_all_reduce_min",
    "test_all_reduce_max",
    "test_all_reduce_sum_async",
    "test_all_reduce_sum_complex",
    "test_all_reduce_complex_unsupported_ops",
    "test_all_reduce_full_group_sum",
    "test_broadcast",
    "test_broadcast_full_group",
    "test_reduce_sum",
    "test_reduce_max",
    "test_reduce_sum_twice",
    "test_all_gather",
    "test_all_gather_complex",
    "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_with_empty",
    "test_gather",
    "test_gather_checks",
    "test_scatter",
    "test_scatter_checks",
    "test_barrier",
    # point to point
    "test_send_recv",
    "test_send_recv_any_source",
    "test_send_recv_with_tag",
    "test_isend",
    "test_irecv",
    # group management
    "test_get_backend",
    "test_get_rank_size_group",
    "test_destroy_group",
    # DDP on CPU
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_ddp_logging_data_cpu",
    "test_static_graph_api_cpu",
)

PASS_GLOO_GATES: tuple[str, ...] = (
    "test_all_reduce_coalesced_sum",
    "test_all_reduce_coalesced_max",
    "test_all_reduce_coalesced_full_group_product",
    "test_barrier_timeout_global",
    "test_batch_isend_irecv_gloo",
    "test_batch_isend_irecv_gloo_tags",
    "test_get_future",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_scatter_object_list",
    "test_all_gather_object_default_pg",
    "test_sparse_all_reduce_sum",
    "test_grads_same_across_ranks_with_no_sync",
)

#: Tests that cannot pass with gloo's gates on a vcga group, and why. Excluded from pass B.
GLOO_GATES_CANNOT_PASS: dict[str, str] = {
    "test_get_backend": "asserts that get_backend() returns the BACKEND name, 'gloo'",
    "test_monitored_barrier_gloo": "torch.distributed.monitored_barrier accepts gloo groups only, by name "
                                   "(vcga's is group.monitored_barrier / Communicator.monitored_barrier)",
    "test_monitored_barrier_gloo_subgroup": "same: monitored_barrier is gated on the name 'gloo'",
    "test_monitored_barrier_gloo_rank_0_timeout": "same: monitored_barrier is gated on the name 'gloo'",
}
