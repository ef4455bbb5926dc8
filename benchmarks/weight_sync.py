"""How long a new policy version takes to reach the rollout engines, by channel, on this CPU.

A random-init model of Qwen3-0.6B's shape (28 layers, hidden 1024, Qwen3's 151,936-token vocabulary,
tied embeddings; `--layers` makes it shallower) is trained by nobody: a stand-in learner holds it in
fp32 (the master weights) and each round hands version v to the engines in `--dtype`:

- `snapshot_s`: the learner's copy for colocated engines (`engine_state`: fp32 masters cast to `--dtype`);
- `checkpoint_write_s`: `save_pretrained` of that copy (the learner writes it before every commit);
- `hf_from_memory_s` / `hf_from_checkpoint_s`: the `hf` engine loading the copy / the folder;
- `vllm_from_memory_s` / `vllm_from_checkpoint_s`: the in-process `vllm` engine, the same two ways;
- `openai_reload_s`: a separate `vllm` server (the `openai` engine's fleet, dev mode) reloading the
  folder through `POST /collective_rpc`.

Every figure is the median of `--rounds` (3) rounds after an untimed warm-up load of each kind; memory
and folder go first in turn.
Simplification: the folder was just written, so it is read from the page cache, not the disk: the
checkpoint figures are a lower bound. Without vLLM installed the vLLM figures are null.

Run: `python benchmarks/weight_sync.py` (about 5 minutes on 2 cores; `--layers 4` for a quick look).
Writes `benchmarks/results/weight_sync.json` with the figures above, `hf_memory_speedup`,
`vllm_memory_speedup`, `parameters` and `dtype`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

import torch  # noqa: E402

from benchmarks.common import print_rows, write_results  # noqa: E402
from marsrl_core.engines.hf import HFEngine  # noqa: E402
from marsrl_core.learn.checkpoint import engine_state  # noqa: E402
from tests.qwen3 import QWEN3_0_6B, qwen3_config, qwen3_tokenizer_files  # noqa: E402
from tests.servers import start_vllm_server  # noqa: E402

CONTEXT = 256


def build_model(folder: Path, layers: int, dtype: torch.dtype):
    """A random Qwen3-0.6B-shaped model with `layers` layers (fp32, the learner's masters), saved to
    `folder` in `dtype` with Qwen3's tokenizer (what the engines start from)."""
    from transformers import Qwen3ForCausalLM

    config = qwen3_config(CONTEXT, **(QWEN3_0_6B | {"num_hidden_layers": layers}))
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    qwen3_tokenizer_files(folder)
    save(model, folder, engine_state(model, dtype), dtype)
    return model


def timed(fn, *args):
    """(what `fn(*args)` returns, the seconds it took)."""
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def save(model, folder: Path, state: dict, dtype: torch.dtype) -> None:
    """The learner's checkpoint folder: `state` (in `dtype`) with the config saying so."""
    model.config.dtype = dtype
    model.save_pretrained(folder, state_dict=dict(state))  # a dict of its own: save_pretrained edits the one it gets
    model.config.dtype = torch.float32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28, help="Decoder layers (28: Qwen3-0.6B's shape).")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    try:
        import vllm  # noqa: F401

        has_vllm = True
    except ImportError:
        has_vllm = False

    with tempfile.TemporaryDirectory(prefix="marsrl-weight-sync-") as tmp:
        start_folder = Path(tmp) / "start"
        learner = build_model(start_folder, args.layers, dtype)
        parameters = sum(p.numel() for p in learner.parameters())
        engines = {"hf": HFEngine.from_pretrained(start_folder, dtype=args.dtype)}
        server = None
        if has_vllm:
            from marsrl_core.engines.openai import OpenAIEngine
            from marsrl_core.engines.vllm import VLLMEngine

            engines["vllm"] = VLLMEngine(start_folder, max_model_len=CONTEXT, dtype=args.dtype)
            server, base = start_vllm_server(start_folder, CONTEXT, args.dtype, 600)
            engines["openai"] = OpenAIEngine(base)
        seconds: dict[str, list[float]] = {}
        try:
            for name in ("hf", "vllm"):  # warm-up, not timed: each engine's first load of either kind
                if name in engines:
                    engines[name].update_weights(0, engine_state(learner, dtype))
                    engines[name].update_weights(0, start_folder)
            for version in range(1, args.rounds + 1):
                with torch.no_grad():  # the learner's step: every weight moves
                    for p in learner.parameters():
                        p.add_(1e-3)
                state, took = timed(engine_state, learner, dtype)
                seconds.setdefault("snapshot_s", []).append(took)
                folder = Path(tmp) / f"v{version}"
                seconds.setdefault("checkpoint_write_s", []).append(timed(save, learner, folder, state, dtype)[1])
                for name in ("hf", "vllm"):
                    if name in engines:
                        ways = [("memory", state), ("checkpoint", folder)]
                        for way, weights in ways if version % 2 else ways[::-1]:  # each first in turn
                            took = timed(engines[name].update_weights, version, weights)[1]
                            seconds.setdefault(f"{name}_from_{way}_s", []).append(took)
                if "openai" in engines:
                    reload = timed(engines["openai"].update_weights, version, folder)[1]
                    seconds.setdefault("openai_reload_s", []).append(reload)
                # The copy reached the engines: the hf engine holds exactly the version's weights.
                held = engines["hf"].model.state_dict()
                assert all(torch.equal(held[k], state[k]) for k in state), "the hf engine holds other weights"
        finally:
            if server is not None:
                engines["openai"].close()
                server.terminate()
                server.wait(timeout=60)

    figures: dict = {"parameters": parameters, "dtype": args.dtype, "layers": args.layers, "rounds": args.rounds}
    for key in ("snapshot_s", "checkpoint_write_s", "hf_from_memory_s", "hf_from_checkpoint_s"):
        figures[key] = statistics.median(seconds[key])
    for key in ("vllm_from_memory_s", "vllm_from_checkpoint_s", "openai_reload_s"):
        figures[key] = statistics.median(seconds[key]) if key in seconds else None
    figures["hf_memory_speedup"] = figures["hf_from_checkpoint_s"] / figures["hf_from_memory_s"]
    figures["vllm_memory_speedup"] = (
        figures["vllm_from_checkpoint_s"] / figures["vllm_from_memory_s"] if has_vllm else None
    )
    figures["runs_s"] = seconds
    rows = [[key, value] for key, value in figures.items() if key.endswith("_s") and key != "runs_s" and value]
    print_rows(
        f"weight sync, {parameters / 1e6:.0f}M parameters in {args.dtype} (median of {args.rounds})",
        ["step", "seconds"],
        rows,
    )
    print(f"from memory instead of the folder: hf {figures['hf_memory_speedup']:.2f}x", end="")
    print(f", vllm {figures['vllm_memory_speedup']:.2f}x" if has_vllm else "")
    print(f"figures written to {write_results('weight_sync', figures)}")


if __name__ == "__main__":
    main()
