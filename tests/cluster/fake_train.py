"""A stand-in for ``tessera train`` that honours the same contract in milliseconds.

It reads the overrides real mode passes (strategy, train.max_steps, train.output_dir) and
``--nproc``; keeps its step in ``checkpoint.json``; appends ``metrics.jsonl`` records with
``step``, ``loss``, ``tokens_per_s`` and the ``dp``, ``gbs`` and ``lr`` it ran with; stops
with a checkpoint when a ``PAUSE`` file appears. ``fake.crash_at=K`` makes it exit 3 on
reaching step K (once, or on every launch with ``fake.crash_always=1``); ``fake.step_s`` sets
its step time.
"""

import json
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    opts = dict(a.split("=", 1) for a in argv if "=" in a)
    nproc = int(argv[argv.index("--nproc") + 1])
    out = Path(opts["train.output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text("data:\n  seq_len: 4\n")
    ckpt = out / "checkpoint.json"
    step = json.loads(ckpt.read_text())["step"] if ckpt.is_file() else 0
    step_s = float(opts.get("fake.step_s", 0.05))
    gbs = int(opts["strategy"].split("gbs=")[1].split(",")[0])
    crash_at = int(opts.get("fake.crash_at", 0))
    while step < int(opts["train.max_steps"]):
        time.sleep(step_s / nproc)
        step += 1
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "loss": 1.0 / step, "dp": nproc, "time": time.time(),
                                "gbs": gbs, "lr": float(opts.get("train.learning_rate", 0)),
                                "tokens_per_s": gbs * 4 * nproc / step_s}) + "\n")
        marker = out / "crashed"
        if step == crash_at and (opts.get("fake.crash_always") or not marker.exists()):
            marker.touch()
            print("RuntimeError: injected crash", flush=True)
            return 3
        ckpt.write_text(json.dumps({"step": step}))
        if (out / "PAUSE").exists():
            (out / "PAUSE").unlink()
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
