"""The Python parts of scripts/gpu_check.sh, one subcommand each:

  site DIR            DIR/pagedserve -> this checkout's services/ and shared/, and a dist-info with the
                      package's entry points (the policies), so nothing is built or installed
  parity OUT.json     tiny random checkpoints of every family, float32 greedy on DEVICE: the engine
                      (alone, batched with prefix caching, preempted, with ngram speculation) against
                      transformers on the same device
  random-model SHAPE DIR   a random-weight HF folder: smollm2 (SmolLM2-135M's config) or tiny (one layer)
  report OUT          markdown of the JSON the parts wrote in OUT

DEVICE: $GPU_CHECK_DEVICE, else cuda where there is one, else cpu (the fallback this runs under on CPUs);
$GPU_CHECK_FAMILIES (comma-separated): parity on these families only.
"""

from __future__ import annotations

import json
import os
import sys
import time
import tomllib
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tests' factories
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
# SmolLM2-135M-Instruct's config.json; tiny: the peers kit's one-layer model (6.4M parameters)
SHAPES = {"smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64),
          "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32)}
SMOLLM2_COMMON = dict(vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, bos_token_id=1,
                      eos_token_id=2, hidden_act="silu")


def device() -> str:
    import torch

    return os.environ.get("GPU_CHECK_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


def make_site(site: Path) -> None:
    package = site / "pagedserve"
    package.mkdir(parents=True, exist_ok=True)
    for top in ("services", "shared"):
        link = package / top
        if not link.exists():
            link.symlink_to(REPO / top, target_is_directory=True)
    with open(REPO / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    info = site / f"pagedserve-{project['version']}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: pagedserve\nVersion: {project['version']}\n")
    groups = {"console_scripts": project["scripts"], **project["entry-points"]}
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in items.items()) + "\n"
        for group, items in groups.items()))


def hf_greedy_on(model, prompt: list[int], max_new_tokens: int, on: str) -> list[int]:
    """transformers' greedy tokens on the device (no cache: the whole sequence re-run per token)."""
    import torch

    ids = torch.tensor([prompt], device=on)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def _family_checks(name: str, directory: Path, on: str) -> dict:
    from pagedserve.services.engine import Engine
    from pagedserve.shared.config import EngineConfig
    from tests.e2e.test_engine_families import GREEDY, MAX_NEW_TOKENS, _prompts
    from tests.gpu_worker.family_checkpoints import save_checkpoint

    hf_model = save_checkpoint(name, directory).to(on)
    prompts = _prompts()
    expected = [hf_greedy_on(hf_model, p, MAX_NEW_TOKENS, on) for p in prompts]

    def engine(**overrides) -> Engine:
        config = dict(model=str(directory), dtype="float32", device=on, block_size=4, num_blocks=128,
                      max_num_batched_tokens=32)
        return Engine(EngineConfig(**{**config, **overrides}))

    def tokens(e: Engine) -> list[list[int]]:
        out = [o.token_ids for o in e.generate(prompts, GREEDY)]
        e.block_manager.check_integrity()
        return out

    alone = engine(enable_prefix_caching=False)
    checks = {"backend": alone.worker.backend.name,
              "alone": [alone.generate([p], GREEDY)[0].token_ids for p in prompts] == expected}
    batched = engine()
    checks["batched_prefix_cached"] = tokens(batched) == expected and tokens(batched) == expected
    small = engine(num_blocks=24)
    checks["preempted"] = tokens(small) == expected and small.scheduler.stats().num_preemptions_total >= 1
    spec = engine(speculative_config=SPEC)
    checks["ngram_speculation"] = tokens(spec) == expected
    checks["accepted_drafts"] = spec.scheduler.spec_decode_totals().get("spec_decode_num_accepted_tokens_total", 0)
    return checks


def parity(out: Path) -> int:
    import tempfile

    from tests.gpu_worker.family_checkpoints import FAMILIES

    on, results = device(), {}
    for name in os.environ.get("GPU_CHECK_FAMILIES", "").split(",") if os.environ.get("GPU_CHECK_FAMILIES") \
            else sorted(FAMILIES):
        started = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as directory:
                results[name] = _family_checks(name, Path(directory), on)
        except Exception:  # one family's failure is reported, the others still run
            results[name] = {"error": traceback.format_exc()}
        results[name]["seconds"] = round(time.perf_counter() - started, 1)
        print(name, json.dumps(results[name]), flush=True)
        out.write_text(json.dumps({"device": on, "families": results}, indent=2))  # each family: a limit may cut
    passed = all(all(v for k, v in r.items() if k not in ("seconds", "accepted_drafts", "backend"))
                 and "error" not in r for r in results.values())
    return 0 if passed else 1


def random_model(shape: str, directory: Path) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(**SMOLLM2_COMMON, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device()):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)


def report(out: Path) -> None:
    """Markdown of the parts' JSON in out: parity per family, the bench rows."""
    parity_file = out / "parity.json"
    if parity_file.exists():
        data = json.loads(parity_file.read_text())
        keys = ["backend", "alone", "batched_prefix_cached", "preempted", "ngram_speculation", "accepted_drafts",
                "seconds"]
        print(f"\n## Greedy parity with transformers ({data['device']}, float32, 4 prompts x 32 tokens)\n")
        print("| family | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
        for name, checks in data["families"].items():
            if "error" in checks:
                print(f"| {name} | error: {checks['error'].strip().splitlines()[-1][:150]} |")
            else:
                print(f"| {name} | " + " | ".join(str(checks.get(k, "")) for k in keys) + " |")
    for bench in sorted(out.glob("bench-*.json")):
        rows = json.loads(bench.read_text())
        keys = ["device", "dtype", "wall_s", "output_tok_s", "total_tok_s", "ttft_p50_ms", "itl_p50_ms", "num_steps"]
        print(f"\n## bench throughput, {rows[0].get('workload')}, {bench.stem.removeprefix('bench-')} "
              "(random weights)\n")
        print("| system | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
        for row in rows:
            print(f"| {row['system']} | " + " | ".join(_cell(row.get(k)) for k in keys) + " |")


def _cell(value) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def main(argv: list[str]) -> int:
    command, *rest = argv
    if command == "site":
        make_site(Path(rest[0]))
        return 0
    if command == "parity":
        return parity(Path(rest[0]))
    if command == "report":
        report(Path(rest[0]))
        return 0
    if command == "random-model":
        random_model(rest[0], Path(rest[1]))
        return 0
    raise SystemExit(f"unknown subcommand {command!r}: site, parity, random-model or report")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
