import torch

from kvtier.baselines.host_tokens import HostTokens


def _tokens(start, count):
    return torch.arange(start, start + count, dtype=torch.float32)[None, None, :, None].expand(2, 3, count, 4)


def test_tokens_leave_from_the_front_in_the_order_they_came():
    host = HostTokens(batch=2, heads=3, head_dim=4, dtype=torch.float32)
    host.append(_tokens(0, 50), -_tokens(0, 50))
    host.append(_tokens(50, 30), -_tokens(50, 30))  # past the first 64 slots: the buffers grow
    keys, values = host.pop_front(32)
    torch.testing.assert_close(keys, _tokens(0, 32))
    torch.testing.assert_close(values, -_tokens(0, 32))
    assert host.used == 48
    torch.testing.assert_close(host.keys, _tokens(32, 48))
    torch.testing.assert_close(host.values, -_tokens(32, 48))
    host.append(_tokens(80, 1), -_tokens(80, 1))
    torch.testing.assert_close(host.keys, _tokens(32, 49))
