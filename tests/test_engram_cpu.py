"""``python/epkit/_details/engram_cpu.py``, the CPU path of ``engram_hash`` (backend ``cpu``): without its C++
hash (``_hash_extension`` gone, as in a build without ``epkit._C``) it gives the reference's bits. The op on every
backend is ``test_engram.py``'s.
"""

import torch

from epkit.engram import EngramConfig, engram_hash, hash_params
from epkit.testing import assert_bitwise_equal


def test_engram_hash_cpu_without_the_extension_is_the_reference(monkeypatch):
    from epkit._details import engram_cpu

    monkeypatch.setattr(engram_cpu, "_hash_extension", lambda: None)
    cfg = EngramConfig(vocab_size=1000, ngram_vocab_sizes=(5003, 7001), n_head_per_ngram=3, n_embed_per_ngram=12)
    mult, vocab, off = hash_params(cfg)
    ids = torch.randint(0, cfg.vocab_size, (301, 3), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    want = engram_hash(ids, mult, vocab, off, backend="reference")
    assert_bitwise_equal(engram_hash(ids, mult, vocab, off, backend="cpu"), want, ctx="no epkit._C")
