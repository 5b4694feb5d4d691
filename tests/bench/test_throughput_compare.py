"""`bench throughput --compare-speculation` prints its same_tokens verdict whether or not
--output writes the JSON; the engine runs are stubbed (the real ones: test_bench_commands)."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedserve.services.bench import command, throughput


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(["throughput", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                              "--compare-speculation", *argv])


@pytest.fixture
def runs(monkeypatch):
    """Two stubbed engine runs; tokens[i] is what run i decodes for request "r"."""
    tokens = [[1, 2, 3], [1, 2, 3]]

    def run_engine(requests, args, enable_prefix_caching=None, speculative=None, outputs=None):
        outputs["r"] = tokens.pop(0)
        return {"system": "spec" if speculative else "plain", "output_tok_s": 10.0}

    monkeypatch.setattr(throughput, "run_engine", run_engine)
    monkeypatch.setattr(throughput, "load_workload", lambda name: [])
    return tokens


def _printed_table(out: str) -> dict[str, str]:
    header, first = out.splitlines()[:2]
    return dict(zip(header.split(), first.split(), strict=True))


def test_same_tokens_prints_without_output(runs, capsys):
    assert throughput.run(_args()) == 0
    assert _printed_table(capsys.readouterr().out)["same_tokens"] == "True"


def test_different_tokens_print_false_and_land_in_the_json(runs, capsys, tmp_path):
    runs[1] = [1, 2, 4]
    out = tmp_path / "r.json"
    assert throughput.run(_args("--output", str(out))) == 0
    assert _printed_table(capsys.readouterr().out)["same_tokens"] == "False"
    assert [r.get("same_tokens") for r in json.loads(out.read_text())] == [False, None]
