import pytest
import torch

import gpukit as gk


@pytest.mark.parametrize("make", [lambda: gk.models.fast_cnn(8), gk.models.resnet18])
def test_output_shape_and_channels_last(make):
    torch.manual_seed(0)
    model = make().eval()
    images = torch.randn(2, 3, 32, 32)
    logits = model(images)
    assert logits.shape == (2, 10)
    model = model.to(memory_format=torch.channels_last)
    torch.testing.assert_close(
        model(images.contiguous(memory_format=torch.channels_last)), logits, atol=1e-4, rtol=1e-4
    )


def test_width_scales_parameters():
    small, large = (gk.models.count_parameters(gk.models.fast_cnn(w)) for w in (8, 16))
    assert 3.5 < large / small < 4.1  # convolution weights grow with width²


def test_resnet18_keeps_32x32_resolution_in_the_stem():
    model = gk.models.resnet18()
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)


def test_bad_width():
    with pytest.raises(ValueError, match="width"):
        gk.models.fast_cnn(0)
