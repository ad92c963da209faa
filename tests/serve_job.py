"""The service as tests/test_serve.py runs it: `python -m xstage_dit.serve`'s main, with what a test can ask for
by its prompt: FAIL_PROMPT raises inside the pipeline call on every rank; SLOW_PROMPT makes rank 0 (and so every
rank, which waits for it at the next collective) pause after each step, so a call lasts as long on any CPU. Each
rank prints the code it exits with when main returns one (a test that stops torchrun itself cannot read them)."""
import os
import time

from xstage_dit.serve import service
from xstage_dit.serve.__main__ import exit_now, main

FAIL_PROMPT = "raise inside the call"
SLOW_PROMPT = "take your time"
STEP_PAUSE_S = 0.1


def _faulty(run_batch):
    def run(loaded, batch, on_step=None):
        prompts = {request.prompt for request in batch}
        if FAIL_PROMPT in prompts:
            raise RuntimeError("a failure inside the pipeline call")
        if SLOW_PROMPT in prompts and on_step is not None:
            def on_step_slowly(*report):
                on_step(*report)
                time.sleep(STEP_PAUSE_S)

            return run_batch(loaded, batch, on_step_slowly)
        return run_batch(loaded, batch, on_step)

    return run


if __name__ == "__main__":
    service.run_batch = _faulty(service.run_batch)
    code = main()
    print(f"serve_job: rank {os.environ.get('RANK', '0')} exits {code}", flush=True)
    exit_now(code)
