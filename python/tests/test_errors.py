"""Bad input raises the exception of the CLI's exit code, with a message that names the problem."""

import numpy as np
import pytest

import tarfa


@pytest.fixture(scope="module")
def model(bundle):
    m = tarfa.open(bundle("olmoe-s"), backend="cpu")
    yield m
    m.close()


def test_wrong_dtype(model):
    with pytest.raises(tarfa.InputError, match="integer token ids.*float"):
        model.forward(np.array([1.0, 2.0]))


def test_out_of_range_ids(model):
    vocab = model.config["vocab_size"]
    with pytest.raises(tarfa.InputError, match=str(vocab)):
        model.forward([1, vocab])
    with pytest.raises(tarfa.InputError, match="-1"):
        model.forward([1, -1])
    # one bad sequence of a batch names its index
    with pytest.raises(tarfa.InputError, match="tokens 1"):
        model.forward_batch([[1, 2], [vocab + 5]])


def test_empty_and_two_dimensional(model):
    with pytest.raises(tarfa.InputError, match="no tokens"):
        model.forward([])
    with pytest.raises(tarfa.InputError, match="one dimension"):
        model.forward([[1, 2]])


def test_closed_model(bundle):
    m = tarfa.open(bundle("olmoe-s"), backend="cpu")
    m.close()
    assert m.closed
    with pytest.raises(tarfa.InputError, match="closed"):
        m.forward([1, 2])
    with pytest.raises(tarfa.InputError, match="closed"):
        m.config


def test_missing_bundle(tmp_path):
    with pytest.raises(tarfa.InputError) as e:
        tarfa.open(tmp_path / "nothing-here", backend="cpu")
    assert "nothing-here" in str(e.value)


def test_wrong_root_is_a_verification_failure(bundle):
    with pytest.raises(tarfa.VerificationError):
        tarfa.open(bundle("olmoe-s"), backend="cpu", expect_root="0" * 64)


def test_bad_backend_and_threads(bundle):
    with pytest.raises(tarfa.InputError, match="backend"):
        tarfa.open(bundle("olmoe-s"), backend="tpu")
    with pytest.raises(tarfa.InputError, match="threads"):
        tarfa.open(bundle("olmoe-s"), threads=-1)


def test_no_tokenizer(model):
    with pytest.raises(tarfa.InputError, match="tokenizer"):
        model.tokenizer


def test_exceptions_share_a_base():
    for e in (tarfa.VerificationError, tarfa.InputError, tarfa.EnvironmentError):
        assert issubclass(e, tarfa.TarfaError)
