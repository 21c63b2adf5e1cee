import numpy as np
import pytest

from kvtier.storage.aligned import address_of, aligned_buffer, byte_view, is_aligned
from kvtier.storage.geometry import PAGE


@pytest.mark.parametrize("nbytes", [0, 1, PAGE, 5000, 3 * PAGE])
def test_aligned_buffer_is_page_aligned_zeroed_and_writable(nbytes):
    buf = aligned_buffer(nbytes)
    assert buf.dtype == np.uint8 and buf.nbytes == nbytes
    assert buf.ctypes.data % PAGE == 0
    assert not buf.any()
    buf[:] = 7
    assert (buf == 7).all()


def test_aligned_buffer_rejects_negative_size():
    with pytest.raises(ValueError, match="must not be negative"):
        aligned_buffer(-1)


def test_is_aligned_checks_address_and_length():
    buf = aligned_buffer(3 * PAGE)
    assert is_aligned(buf)
    assert is_aligned(buf[PAGE:])
    assert not is_aligned(buf[1:PAGE + 1])  # address off by one
    assert not is_aligned(buf[:PAGE + 1])  # length not whole pages


def test_byte_view_of_common_buffers_shares_memory():
    array = np.arange(4, dtype=np.float32)
    view = byte_view(array)
    assert view.dtype == np.uint8 and view.nbytes == 16
    view[:4] = 0
    assert array[0] == 0 and address_of(array) == view.ctypes.data
    assert byte_view(b"abc").tobytes() == b"abc"
    assert byte_view(bytearray(b"xy")).flags.writeable
    assert byte_view(memoryview(np.zeros((2, 3), np.int16))).nbytes == 12


def test_byte_view_rejects_non_contiguous_buffers():
    with pytest.raises(ValueError, match="not contiguous"):
        byte_view(np.zeros((4, 4), np.uint8)[:, 1])


def test_byte_view_of_cpu_tensor_shares_memory():
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(8, dtype=torch.float16)
    byte_view(tensor)[:] = 0x3C  # 0x3C3C as float16 is 1.0586
    assert tensor[0].item() == pytest.approx(1.0586, abs=1e-3)
    bf16 = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="uint8"):
        byte_view(bf16)
    assert byte_view(bf16.view(torch.uint8)).nbytes == 8
