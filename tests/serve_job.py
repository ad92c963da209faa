"""The service as tests/test_serve.py runs it: `python -m xstage_dit.serve`'s main, with one fault a test can ask
for: a request whose prompt is FAIL_PROMPT raises inside the pipeline call on every rank."""
from xstage_dit.serve import service
from xstage_dit.serve.__main__ import exit_now, main

FAIL_PROMPT = "raise inside the call"


def _faulty(run_batch):
    def run(loaded, batch, *args, **kwargs):
        if any(request.prompt == FAIL_PROMPT for request in batch):
            raise RuntimeError("a failure inside the pipeline call")
        return run_batch(loaded, batch, *args, **kwargs)

    return run


if __name__ == "__main__":
    service.run_batch = _faulty(service.run_batch)
    exit_now(main())
