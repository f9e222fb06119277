"""The tree inputs a recurrent layer keeps until its commit never alias vLLM's buffers: under vLLM's
piecewise CUDA graphs those are pool memory that later graph pieces overwrite (Qwen3-Next's GDN
``mixed_qkv`` is a dense ``torch.cat``, so ``.contiguous()`` of its rows was a view)."""
import torch

from vllm_bole.adapter.layers.recurrent import owned


def _cat():  # Qwen3-Next's mixed_qkv: dense
    return torch.cat([torch.randn(12, 5), torch.randn(12, 7)], dim=-1)


def _cases():  # fresh buffers per case
    yield _cat()[3:9]
    yield torch.split(torch.randn(12, 30)[3:9, 4:], [20, 6], dim=-1)[0]  # Mamba2's xBC: a column split
    yield torch.split(torch.randn(12, 30)[3:4, 4:], [20, 6], dim=-1)[0]  # one tree token: a dense row
    yield _cat()[3:4]


def test_owned_copies_dense_rows_and_column_splits():
    for x in _cases():
        y = owned(x)
        assert y.is_contiguous() and torch.equal(y, x)
        assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        x.fill_(float("nan"))  # the pool reused: the kept copy is unchanged
        assert not torch.isnan(y).any()
