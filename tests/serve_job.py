"""The service as tests/test_serve.py runs it: `python -m xstage_dit.serve`'s main, with what a test can ask for
by its prompt: FAIL_PROMPT raises inside the pipeline call on every rank; SLOW_PROMPT (and STALL_PROMPT, longer)
makes rank 0 (and so every rank, which waits for it at the next collective) pause after each step, so a call lasts
as long on any CPU, and longer than the service predicts. Each
rank prints the code it exits with when main returns one (a test that stops torchrun itself cannot read them)."""
import os
import time

from xstage_dit.serve import service
from xstage_dit.serve.__main__ import exit_now, main

FAIL_PROMPT = "raise inside the call"
SLOW_PROMPT = "take your time"
STALL_PROMPT = "take all the time"
PAUSES_S = {SLOW_PROMPT: 0.1, STALL_PROMPT: 0.5}  # after each step


def _faulty(run_batch):
    def run(loaded, batch, on_step=None, stop=None):
        prompts = {request.prompt for request in batch}
        if FAIL_PROMPT in prompts:
            raise RuntimeError("a failure inside the pipeline call")
        pause = max((PAUSES_S.get(prompt, 0.0) for prompt in prompts), default=0.0)
        if pause and on_step is not None:
            def on_step_slowly(*report):
                on_step(*report)
                time.sleep(pause)

            return run_batch(loaded, batch, on_step_slowly, stop)
        return run_batch(loaded, batch, on_step, stop)

    return run


if __name__ == "__main__":
    service.run_batch = _faulty(service.run_batch)
    code = main()
    print(f"serve_job: rank {os.environ.get('RANK', '0')} exits {code}", flush=True)
    exit_now(code)
