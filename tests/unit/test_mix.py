"""data.mix (loom.data.mix): realised shares against the weights, rows as a function of the global row index
only (any slicing, any data-parallel degree), a schedule switch showing from its step, exact resume from the
loader's state, repeats announced, and bad mixtures refused before any work. Compared against: the weights
themselves, and the one-process loader's rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from mixkit import WEIGHTS, make_sources

from loom.data.mix import MixLoader, check_sources, mix_weights, parse_mix
from loom.data.slice import WHOLE, DataSlice
from loom.errors import LoomError

T = 16


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return make_sources(tmp_path_factory.mktemp("mix"))


def spec(sources, weights=WEIGHTS) -> str:
    return ",".join(f"{n}={sources[n]}:{w}" for n, w in weights.items())


def loader(sources, batch=8, schedule="", part=WHOLE, repeat="allow", seed=1337, weights=WEIGHTS):
    srcs, w = parse_mix(spec(sources, weights))
    return MixLoader(srcs, mix_weights(w, schedule, srcs), batch, T, seed, part, repeat=repeat)


def shares(src: np.ndarray) -> np.ndarray:
    c = np.bincount(src, minlength=3)
    return c / c.sum()


def test_shares_within_one_percent_after_2000_steps(sources):
    mix = loader(sources)
    read = np.concatenate([mix.plan.rows(s * 8, 8)[0] for s in range(2000)])
    got, want = shares(read), np.array(list(WEIGHTS.values()))
    assert np.abs(got - want).max() < 0.01 * want.min()  # within 1 % of each weight (relative)
    mix.cursor = 2000 * 8
    assert mix.counts().tolist() == np.bincount(read, minlength=3).tolist()  # each source's own cursor
    # every 100 steps already: the quotas hold per block of 1,024 rows
    early = np.concatenate([mix.plan.rows(s * 8, 8)[0] for s in range(128)])
    assert np.abs(shares(early) - want).max() < 0.002


def test_rows_depend_on_the_row_index_only(sources):
    one = loader(sources)
    whole = one.global_rows(0, 96)
    pieces = torch.cat([one.global_rows(a, b - a) for a, b in [(0, 5), (5, 40), (40, 41), (41, 96)]])
    assert torch.equal(whole, pieces)
    ref = loader(sources, batch=8)
    ranks = [loader(sources, batch=8, part=DataSlice(r, 2)) for r in range(2)]
    for _ in range(30):
        x, y = ref.next_batch()
        xs = [r.next_batch() for r in ranks]
        assert torch.equal(x, torch.cat([a for a, _ in xs])) and torch.equal(y, torch.cat([b for _, b in xs]))
    # each source's rows come from its own folder: the source of a row decides its text
    src, _ = one.plan.rows(0, 96)
    assert len(set(src.tolist())) == 3


def test_schedule_switch_shows_from_its_step(sources):
    k = 150
    mix = loader(sources, schedule=f"{k}@web:0.1,code:0.1,math:0.8")
    before = np.concatenate([mix.plan.rows(s * 8, 8)[0] for s in range(k)])
    after = np.concatenate([mix.plan.rows(s * 8, 8)[0] for s in range(k, k + 300)])
    assert np.abs(shares(before) - [0.5, 0.3, 0.2]).max() < 0.01
    assert np.abs(shares(after) - [0.1, 0.1, 0.8]).max() < 0.01
    # the first steps after k already follow the new weights (math dominates from step k on)
    assert shares(np.concatenate([mix.plan.rows(s * 8, 8)[0] for s in range(k, k + 10)]))[2] > 0.6
    # and the rows before k are those of the run without a schedule
    plain = loader(sources)
    assert torch.equal(mix.global_rows(0, k * 8), plain.global_rows(0, k * 8))


def test_resume_from_state_continues_exactly(sources):
    a = loader(sources, schedule="20@web:0.2,code:0.2,math:0.6")
    for _ in range(13):
        a.next_batch()
    state = a.state_dict()
    assert [m["name"] for m in state["mix"]] == list(WEIGHTS)
    assert sum(m["cursor"] for m in state["mix"]) == state["cursor"] == 13 * 8
    b = loader(sources, schedule="20@web:0.2,code:0.2,math:0.6")
    b.load_state_dict(state)
    for _ in range(40):
        assert all(torch.equal(p, q) for p, q in zip(a.next_batch(), b.next_batch(), strict=True))
    other = loader(sources)  # no schedule: other source cursors at step 53 than the checkpoint's
    for _ in range(40):
        other.next_batch()
    with pytest.raises(LoomError, match="differ from this data.mix"):
        other.load_state_dict(a.state_dict())


def test_a_source_read_through_is_announced(sources):
    mix = loader(sources, repeat="error", batch=64)
    n = mix.windows(2)  # math: 0.2 of the rows (web, at 0.5, is read through first)
    steps = int(n / (0.2 * 64)) + 2
    with pytest.raises(LoomError, match="'math' .* epochs"):
        mix.check_repeats(steps)
    mix.check_repeats(1)
    with pytest.raises(LoomError, match="source 'web' has been read through"):
        for _ in range(steps):
            mix.next_batch()
    warn = loader(sources, repeat="warn", batch=64)
    for _ in range(steps):
        warn.next_batch()
    assert warn.state_dict()["mix"][2]["epoch"] >= 1


@pytest.mark.parametrize(
    "text,match",
    [
        ("web:-0.5,code:1", "negative"),
        ("web:0,code:0", "sum to 0"),
        ("nosuch:1", "unknown source 'nosuch'"),
        ("web:1,web:2", "twice"),
        ("web", "not SOURCE:WEIGHT"),
        ("web:inf,code:1", "the weight of 'web' is inf, not a finite number"),
        ("web:1,code:nan", "the weight of 'code' is nan, not a finite number"),
        ("web:abc", "not SOURCE:WEIGHT"),
    ],
)
def test_bad_mixtures_are_refused(sources, text, match):
    named = ",".join(f"{n}={p}" for n, p in sources.items())
    with pytest.raises(LoomError, match=match):
        parse_mix(text, named)


def test_bad_schedule_is_refused(sources):
    srcs, w = parse_mix(spec(sources))
    with pytest.raises(LoomError, match="unknown source 'books'"):
        mix_weights(w, "10@books:1", srcs)
    with pytest.raises(LoomError, match="not after"):
        mix_weights(w, "10@web:1;5@code:1", srcs)


def test_sources_of_another_vocabulary_or_without_end_of_text_are_refused(sources, tmp_path, text_maker):
    from loom.data.prepare import prepare

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(text_maker(4000, seed=9).lower())  # fewer characters: another vocabulary
    prepare([docs], tmp_path / "lower", tokenizer="char", val_fraction=0.25, seed=0)
    srcs, _ = parse_mix(f"web={sources['web']}:1,lower={tmp_path / 'lower'}:1")
    with pytest.raises(LoomError, match="'lower' has .* token ids"):
        check_sources(srcs)
    bare = tmp_path / "bare"  # nanoGPT's layout: ids and a vocabulary, no end-of-text id
    bare.mkdir()
    for split in ("train", "val"):
        np.arange(3000, dtype=np.uint16).__mod__(56).astype(np.uint16).tofile(bare / f"{split}.bin")
    import pickle

    (bare / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 56}))
    srcs, _ = parse_mix(f"web={sources['web']}:1,bare={bare}:1")
    with pytest.raises(LoomError, match="data.doc_mask=true needs each source's end-of-text id.*'bare'"):
        check_sources(srcs, doc_mask=True)
    with pytest.raises(LoomError, match="another tokenizer"):
        check_sources(srcs)


def test_plot_draws_each_source(tmp_path):
    """`loom plot` of a mixture run: two more panels (each source's val loss, each interval's shares)."""
    import json

    from loom.plot import _shares, plot_runs

    recs = [
        {
            "step": s,
            "tokens": s * 10,
            "loss": 3.0,
            "mix_tokens": {"web": 5 * s, "code": 3 * s + 2 * (s > 2) * (s - 2)},
        }
        for s in range(1, 6)
    ]
    recs += [{"step": 5, "tokens": 50, "val_loss/web": 2.5}, {"step": 5, "tokens": 50, "val_loss/code": 2.7}]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert plot_runs([run], tmp_path / "p.png").stat().st_size > 10_000
    mixed = [r for r in recs if "mix_tokens" in r]
    assert [round(v, 3) for _, v in _shares(mixed, "code")] == [0.375, 0.375, 0.5, 0.5, 0.5]


def test_inspect_mix_prints_tokens_and_epochs_per_source(sources, capsys):
    import json

    from loom.cli import main

    named = ",".join(f"{n}={p}" for n, p in sources.items())
    mix = "web:0.5,code:0.3,math:0.2"
    assert main(["data", "inspect", "--mix", mix, "--sources", named, "--tokens", "100000", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["web", "code", "math"]
    web = rows[0]
    assert web["run_tokens"] == 50_000 and web["epochs"] == pytest.approx(50_000 / web["train_tokens"])
    assert main(["data", "inspect", "--mix", mix, "--sources", named, "--tokens", "100000"]) == 0
    out = capsys.readouterr().out
    assert "web " in out and "in 100,000 tokens:         50,000" in out and "epochs" in out
    assert main(["data", "inspect", "--mix", "books:1", "--sources", named]) != 0  # cli prints the LoomError
    assert "unknown source 'books'" in capsys.readouterr().err


@pytest.mark.parametrize("align", ["none", "bos"])
def test_each_row_is_its_sources_own_window(sources, align):
    """The batched gather gives, for a row of source i at index j of that source, the row a ShardLoader of
    source i alone (its seed) gives at j: across its epochs too, and with windows at document starts."""
    from loom.data.loader import ShardLoader
    from loom.data.mix import _source_seed

    srcs, w = parse_mix(spec(sources))
    mix = MixLoader(srcs, mix_weights(w, "", srcs), 64, T, 1337, align=align, repeat="allow")
    start = 3 * mix.windows(0)  # web (0.5 of the rows) well into its second epoch
    src, idx = mix.plan.rows(start, 200)
    rows = mix.global_rows(start, 200)
    for i, name in enumerate(WEIGHTS):
        alone = ShardLoader(sources[name], 64, T, _source_seed(1337, i), align=align)
        for r in np.flatnonzero(src == i)[:20]:
            assert torch.equal(rows[r], alone.global_rows(int(idx[r]), 1)[0])
    assert idx[src == 0].max() > mix.windows(0)


def test_a_toml_file_gives_the_mixture_as_lists(tmp_path, sources):
    """data.mix and data.sources also take TOML lists (kept as the command line's comma lists)."""
    from loom.config import load_config

    toml = tmp_path / "mix.toml"
    named = ", ".join(f'"{n}={p}"' for n, p in sources.items())
    toml.write_text(
        f'[data]\nsources = [{named}]\nmix = ["web:0.5", "code:0.3", "math:0.2"]\n'
        'mix_schedule = "100@web:0.2,code:0.2,math:0.6"\n'
    )
    cfg = load_config(toml)
    assert cfg.data.mix == "web:0.5,code:0.3,math:0.2"
    srcs, w = parse_mix(cfg.data.mix, cfg.data.sources)
    assert [s.path for s in srcs] == [str(p) for p in sources.values()] and w.tolist() == [0.5, 0.3, 0.2]
    assert mix_weights(w, cfg.data.mix_schedule, srcs)[1][0] == 100


def test_explain_rows_commands_print_the_mixture_rows(sources, capsys):
    """A bad step's record under data.mix (MixLoader.explain_rows): each batch row's source and its row in the
    source's own sequence, and one `loom data inspect --rows` command a source; what those commands print
    is, row for row, the batch the mixture gave."""
    import json
    import shlex

    from loom.cli import main

    mix = loader(sources)
    for _ in range(3):
        mix.next_batch()
    state = mix.state_dict()
    rec = mix.explain_rows(state, 8)
    first = state["cursor"]
    assert rec["rows"] == [first, first + 7] and len(rec["sources"]) == 8
    printed = {}
    for cmd in rec["inspect"].split(" && "):
        argv = shlex.split(cmd)
        assert main(argv[1:] + ["--json"]) == 0
        path = argv[3]
        printed.update({(path, r["row"]): r["tokens"] for r in json.loads(capsys.readouterr().out)})
    want = mix.global_rows(first, 8).tolist()
    for k, (name, row) in enumerate(rec["sources"]):
        assert printed[(str(sources[name]), row)] == want[k], (k, name, row)


def test_a_source_named_twice_or_one_folder_under_two_names_is_refused(sources):
    with pytest.raises(LoomError, match="data.sources names 'web' twice"):
        parse_mix("web:1", f"web={sources['web']},web={sources['code']}")
    with pytest.raises(LoomError, match=r"reads the folder .* twice \(as 'web' and 'again'\)"):
        parse_mix(f"web={sources['web']}:1,again={sources['web']}/:1")
    with pytest.raises(LoomError, match="data.mix_schedule: the weight of 'web' is inf"):
        srcs, w = parse_mix(spec(sources))
        mix_weights(w, "10@web:inf", srcs)


def test_mix_repeat_error_refuses_only_a_run_that_reads_a_source_twice(sources, monkeypatch):
    """The most steps that read no source twice run to the end under data.mix_repeat=error, on a device whose
    batches are read a step ahead too (the batch after the last step crosses an epoch: never read, never
    refused; windows were also computed 1,024 rows ahead and announced from there, which stopped such a run
    at step 33 of 35); one step more is refused at start, naming the step the second epoch starts at and the
    epoch reached."""
    from loom import device
    from loom.data.loader import DeviceBatches

    monkeypatch.setattr(device, "ASYNC", (*device.ASYNC, "cpu"))  # read one batch ahead, as on a GPU
    mix = loader(sources, batch=64, repeat="error")
    n = np.array([mix.windows(i) for i in range(3)])
    steps = 1
    while (mix.counts((steps + 1) * 64) <= n).all():
        steps += 1
    mix.check_repeats(steps)
    batches = DeviceBatches(mix, torch.device("cpu"))
    for _ in range(steps):
        batches.next_batch()
    with pytest.raises(LoomError, match="'web' has been read through and starts epoch 2"):
        batches.next_batch()  # the step after: it does read the second epoch
    over = loader(sources, batch=64, repeat="error")
    with pytest.raises(
        LoomError, match=rf"'web' 1.0\d epochs \(epoch 2 from step {steps + 1}, up to epoch 2\)"
    ):
        over.check_repeats(steps + 1)
    reach = -(-int(over.counts(3 * steps * 64)[0]) // n[0])  # the epoch of web's last row, 1-based
    assert reach == 3
    with pytest.raises(
        LoomError, match=rf"'web' 2.\d\d epochs \(epoch 2 from step {steps + 1}, up to epoch 3\)"
    ):
        over.check_repeats(3 * steps)


def test_the_hint_for_char_sources_of_different_texts_runs_as_written(tmp_path, monkeypatch):
    """Two char sources of different texts have two vocabularies: the error says how to prepare them with one
    tokenizer, and its commands run as written; the folders they make mix."""
    from loom.cli import main

    monkeypatch.chdir(tmp_path)
    Path("a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    Path("b.txt").write_text("def f(x):\n    return x * 2 + 1\n" * 200)
    for name in ("a", "b"):
        assert main(["data", "prepare", "--input", f"{name}.txt", "--tokenizer", "char", "--out", name]) == 0
    srcs, _ = parse_mix("a:0.5,b:0.5")
    with pytest.raises(LoomError) as e:
        check_sources(srcs)
    hint = e.value.hint
    assert "char vocabularies hold only their own text's characters" in hint
    commands = hint.split("given to the other: ", 1)[1].split(", then mix")[0].split(" && ")
    assert len(commands) == 2
    for c in commands:
        assert main(c.split()[1:]) == 0, c
    srcs, _ = parse_mix("a-bpe:0.5,b-bpe:0.5")
    assert len(check_sources(srcs)) == 2  # one tokenizer: they mix
