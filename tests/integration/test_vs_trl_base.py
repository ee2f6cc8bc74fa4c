"""benchmarks/vs_trl_grpo.py --base scores both sides with ONE evaluator (transformers greedy generation on each
exported folder): on a base run's export it must read a prompt as the raw text loom's base-model RL reads and cut
the answer where rl.stop='\\n' cuts it, so its greedy answers are loom's own engine's, answer for answer."""

import importlib.util
import json
import types

from rlkit import MODEL, ROOT, make_arith
from sftkit import QUIET

from loom.cli import main


def _bench():
    spec = importlib.util.spec_from_file_location("vs_trl_grpo", ROOT / "benchmarks" / "vs_trl_grpo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _loom_greedy(run, rows: list[dict], max_new: int) -> list[str]:
    """loom's held-out greedy answers (loom.rl.heldout's path: the engine, the stop text, answer_text)."""
    import torch

    from loom.rl.prompts import TextTemplate
    from loom.rl.rollout import answer_text, sample
    from loom.runs import load_run

    _, model, tok, meta, _ = load_run(run, torch.device("cpu"))
    tpl = TextTemplate(tok)
    ids = [tpl.encode_prompt(r["prompt"], "test") for r in rows]
    args = (max_new, tpl.stop_ids, meta["vocab_size"])
    reqs = sample(model, ids, [[0]] * len(ids), *args, temperature=0.0, stops=("\n",), decode=tok.decode)
    return [answer_text(tok, q, ("\n",)) for q in reqs]


def test_base_mode_evaluator_gives_loom_engines_greedy_answers(tmp_path):
    make_arith(tmp_path / "arith", "--digits", "1", "--n-train", "80", "--n-heldout", "16", "--n-sft", "4")
    (tmp_path / "base.txt").write_text((tmp_path / "arith" / "base.txt").read_text() * 5)
    text = tmp_path / "text"
    assert (
        main(
            [
                "data",
                "prepare",
                "--input",
                str(tmp_path / "base.txt"),
                "--out",
                str(text),
                "--tokenizer",
                "char",
            ]
        )
        == 0
    )
    runs = tmp_path / "runs"
    train = [f"--data.path={text}", f"--run.dir={runs}", "--run.name=base", *MODEL, *QUIET]
    assert main(["train", *train, "--train.steps=40", "--train.batch_size=8", "--optim.lr=3e-3"]) == 0
    assert main(["export", str(runs / "base"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    rows = [json.loads(x) for x in open(tmp_path / "arith" / "rl_heldout.jsonl")]
    a = types.SimpleNamespace(base=True, max_new_tokens=4, reward="0.2*regex+exact", pattern=r"^\d+$")
    got = _bench().greedy_answers(tmp_path / "hf", rows, a)
    assert got == _loom_greedy(runs / "base", rows, 4)
    # the answers stop at the newline the base run learnt to write after a sum: some are digits only
    assert any(t.isdigit() for t in got), got
