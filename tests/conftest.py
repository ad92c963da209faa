import gc
import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in Triton's CPU interpreter (set before any kernel module is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # the suite computes tiny models on the CPU: a second thread gains little on ops that small and makes each op
    # wait for a core whenever the cores are shared (the ranks of the harness, other jobs on the machine); the ranks
    # run one thread each likewise (dist_harness), and the processes that tests start inherit the setting
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # what the ranks' fork server imports, imported here too: every kernel defined interpreted (dist_harness)
    import dist_harness
    for module in dist_harness.PRELOADED:
        importlib.import_module(module)


# `pytest -m quick`: minutes on 2 cores where the whole suite takes about 13; each area's fast checks and one run of
# each distributed path (node ids under tests/, a whole module or the start of a test's id)
QUICK = (
    "test_layers.py", "test_docs.py", "test_backend_registry.py", "test_provenance.py", "test_step_timer.py",
    "test_burst_gap.py", "test_planner.py", "test_cli.py::test_help_and_version_answer_at_once",
    "test_cli.py::test_a_bad_argument_of_xstage_dit",
    "test_cli.py::test_degrees_that_do_not_fit_the_ranks_are_refused_once_for_the_job[ulysses-2]",
    "test_api.py::test_a_config_checks_itself_as_it_is_made", "test_api.py::test_bad_degrees_and_backends",
    "test_api.py::test_single_process_output_is_unchanged",
    "test_api.py::test_enable_twice_is_refused_and_disable_restores_exactly",
    "test_api.py::test_shards_cover_the_sequence", "test_ring.py::test_the_degrees_the_job_runs",
    "test_ring.py::test_degrees_that_do_not_fit_are_refused",
    "test_parallel_pipelines.py::test_overlap_backend_matches_single_process[2-",
    "test_agreement.py::test_ranks_that_disagree_are_named[backend]",
    "test_parallel_vae.py::test_row_split_decode_matches_one_process", "test_moe.py::test_grouped_moe_matches",
    "test_kernels.py::test_rotary_interpreted", "test_generate.py::test_an_input_image_reaches_the_pipeline",
    "test_serve.py::test_health_models_metrics_and_an_image", "test_serve.py::test_the_queue_batches",
)


@pytest.fixture(autouse=True)
def _cpu_paths(request, monkeypatch):
    """Tests marked cpu_paths run the library as a CPU user does: without Triton's interpreter, which runs our
    kernels as slow Python. The kernels are defined interpreted once (TRITON_INTERPRET=1 above);
    the library reads the variable at each call (kernels.triton_runs_on), as do the ranks and services a test
    starts with its environment. A test also marked `kernels` keeps the interpreter."""
    marked = request.node.get_closest_marker
    if marked("cpu_paths") and not marked("kernels") and not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if item.nodeid.removeprefix("tests/").startswith(QUICK):
            item.add_marker(pytest.mark.quick)


def pytest_collection_finish(session):
    # the libraries' objects, loaded by now, are left out of the cyclic garbage collector's passes: traversing them
    # made each full collection take about a second
    gc.freeze()
