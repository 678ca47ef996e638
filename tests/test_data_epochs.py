"""Each step's batch as pretraining reads it, through raytp.data.corpus.batch on real token files: over one
epoch every training window is used exactly once, at DP = 1, 2 and across a DP resize; a 0.7/0.3 blend of two
sources keeps those proportions in every step within one sample; the validation documents never appear in
training."""
import numpy as np
import pytest

from raytp.data.indexed import write_indexed
from raytp.data.corpus import batch, load_corpus

BLOCK, BATCH = 16, 8


def windows_of(x: np.ndarray) -> list[int]:
    """The window each row is (ids are positions in the file, so a row's first id says where it starts)."""
    assert (x[:, 0] % BLOCK == 0).all()
    return (x[:, 0] // BLOCK).tolist()


@pytest.fixture
def positions(tmp_path):
    """A nanoGPT .bin whose id at each position is the position itself (uint32), so rows say where they are."""
    ids = np.arange(BLOCK * 125 + 1, dtype=np.uint32)
    ids.tofile(tmp_path / "pos.bin")
    return load_corpus(str(tmp_path / "pos.bin"), 0.2, dtype="uint32")


def test_every_window_once_per_epoch_at_dp_1_2_and_across_a_resize(positions):
    n = positions.windows("train", BLOCK)[0]
    steps = n // BATCH  # whole steps of one epoch
    for dps in ([1] * steps, [2] * steps, [2] * (steps // 2) + [1] * (steps - steps // 2)):
        seen = []
        for step, dp in enumerate(dps):
            for r in range(dp):
                x, y = batch(positions, "train", 7, step, r, dp, BATCH, BLOCK)
                assert (x[:, 1:] == y[:, :-1]).all() and (y[:, -1] == x[:, -1] + 1).all()
                seen += windows_of(x.numpy())
        assert len(seen) == len(set(seen)) == steps * BATCH  # none twice ...
    first = [w for s in range(steps) for w in windows_of(batch(positions, "train", 7, s, 0, 1, BATCH, BLOCK)[0].numpy())]
    per_epoch = n // BATCH * BATCH  # whole steps of the second epoch start at sample n
    later = [w for s in range(n // BATCH + 1, 2 * n // BATCH)
             for w in windows_of(batch(positions, "train", 7, s, 0, 1, BATCH, BLOCK)[0].numpy())]
    assert len(later) >= per_epoch // 2 and later != first[:len(later)]  # ... and the next epoch in a new order


def test_a_blend_keeps_its_weights_every_step_and_reads_each_source_in_epochs(tmp_path):
    rng = np.random.default_rng(0)
    web = [rng.integers(0, 1000, rng.integers(30, 90)) for _ in range(60)]
    code = [rng.integers(1000, 2000, rng.integers(30, 90)) for _ in range(60)]
    write_indexed(tmp_path / "web", web, np.uint16)
    write_indexed(tmp_path / "code", code, np.uint16)
    corpus = load_corpus("builtin", 0.1, mix={str(tmp_path / "web.bin"): 0.7, str(tmp_path / "code.bin"): 0.3})
    assert corpus.weights == (0.7, 0.3) and "0.7 x Megatron-LM" in corpus.description
    for step in range(50):
        x, _ = batch(corpus, "train", 1, step, 0, 1, BATCH, BLOCK)
        web_rows = int((x[:, 0] < 1000).sum())
        assert web_rows in (5, 6)  # 0.7 x 8 = 5.6
        assert ((x < 1000).all(dim=1) | (x >= 1000).all(dim=1)).all()  # a row is from one source
    val_x, _ = batch(corpus, "val", 1, 0, 0, 1, BATCH, BLOCK)
    assert int((val_x[:, 0] < 1000).sum()) in (5, 6)  # validation blends the held-out documents alike


def test_validation_documents_are_not_trained_on(tmp_path):
    docs = [np.full(40, i, dtype=np.int64) for i in range(1, 101)]  # document i is all i's
    write_indexed(tmp_path / "docs", docs, np.uint16)
    corpus = load_corpus(str(tmp_path / "docs.bin"), 0.1)
    val_ids = set(np.concatenate(corpus.val[0].pieces).tolist())
    train_ids = set(np.concatenate(corpus.train[0].pieces).tolist())
    assert len(val_ids) == 10 and not val_ids & train_ids and len(train_ids) == 90
    assert min(val_ids) < 20 and max(val_ids) > 80  # held out from all over the file, not its tail
    seen = set()
    for step in range(40):
        x, _ = batch(corpus, "train", 3, step, 0, 1, BATCH, BLOCK)
        seen |= set(x.unique().tolist())
    assert not seen & val_ids


def test_a_separate_validation_source(tmp_path):
    write_indexed(tmp_path / "train", [np.full(50, 1)] * 20, np.uint16)
    write_indexed(tmp_path / "held", [np.full(50, 2)] * 5, np.uint16)
    corpus = load_corpus(str(tmp_path / "train.bin"), 0.1, val_source=str(tmp_path / "held.bin"))
    assert (batch(corpus, "train", 0, 0, 0, 1, BATCH, BLOCK)[0] == 1).all()
    assert (batch(corpus, "val", 0, 0, 0, 1, BATCH, BLOCK)[0] == 2).all()
    assert "validation: Megatron-LM" in corpus.description
    with pytest.raises(ValueError, match="data.val_source: .*missing.bin does not exist"):
        load_corpus(str(tmp_path / "train.bin"), 0.1, val_source=str(tmp_path / "missing.bin"))
    with pytest.raises(ValueError, match="data.mix: .*nope.bin does not exist"):
        load_corpus("builtin", 0.1, mix={str(tmp_path / "train.bin"): 1, str(tmp_path / "nope.bin"): 1})


def test_empty_or_too_small_data_is_refused_before_the_start(tmp_path):
    import dataclasses
    from helpers import job
    from raytp.api.errors import BadJob
    from raytp.api.job import check_data
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("")
    np.arange(20, dtype=np.uint16).tofile(tmp_path / "tiny.bin")
    cfg = job()
    for source, message in ((tmp_path / "empty.bin", r".*empty.bin is empty: no token ids"),
                            (tmp_path / "texts", r"the 1 text files under .* are empty"),
                            (tmp_path / "tiny.bin", r"the training split of .* holds 18 tokens, fewer than "
                                                    r"model.block_size\+1 = 33")):
        with pytest.raises(BadJob, match=f"^data.source: {message}" if "split" not in message else message):
            check_data(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source=str(source))))


def test_sources_of_different_tokenizers_are_not_blended(tmp_path):
    from offline import write_prepared
    a = write_prepared(tmp_path / "a", 0, 0, 100)
    b = write_prepared(tmp_path / "b", 1, 0, 100, eod=254)
    with pytest.raises(ValueError, match=r"data: the sources were prepared with different end-of-document ids: "
                                         r".*a \(255\), .*b \(254\)"):
        load_corpus("builtin", 0.1, mix={a: 1, b: 1})
    c = write_prepared(tmp_path / "c", 2, 0, 100, sha="other")
    with pytest.raises(ValueError, match=r"different tokenizers: .*a \(test\), .*c \(other\)"):
        load_corpus(a, 0.1, val_source=c)
