"""llama.cpp's min-p and penalties (repeat; OpenAI's frequency and presence) against numpy reference math on fixed
logits."""
import numpy as np
import pytest

from flashinfer_lite.generate import Sampler


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def test_min_p_keeps_tokens_within_min_p_of_the_top_probability():
    logits = np.log(np.array([0.40, 0.30, 0.15, 0.10, 0.03, 0.019, 0.001])).astype(np.float32)
    for min_p in (0.05, 0.3, 0.5):
        p = softmax(logits.astype(np.float64))
        allowed = set(np.flatnonzero(p >= min_p * p.max()))
        s = Sampler(temp=1.0, top_k=0, top_p=1.0, min_p=min_p, seed=0)
        draws = np.array([s(logits) for _ in range(6000)])
        assert set(draws) == allowed
        want = p * np.isin(np.arange(len(p)), list(allowed))
        counts = np.bincount(draws, minlength=len(p)) / len(draws)
        np.testing.assert_allclose(counts, want / want.sum(), atol=0.02)


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits_of_the_last_n():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=50).astype(np.float32)
    history = [3, 7, 7, 11, 20, 3, 41, 2]
    s = Sampler(temp=0, repeat_penalty=1.3, repeat_last_n=5)
    want = logits.astype(np.float64).copy()
    for t in set(history[-5:]):            # 20, 3, 41, 2, 11
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    np.testing.assert_allclose(s.penalize(logits, history), want, rtol=1e-6)
    assert s(logits, history) == int(np.argmax(want))
    # a penalty large enough moves greedy off the repeated top token
    top = int(np.argmax(logits))
    assert Sampler(temp=0, repeat_penalty=100.0)(logits, [top]) != top
    assert Sampler(temp=0, repeat_penalty=100.0, repeat_last_n=0)(logits, [top]) == top


def test_frequency_and_presence_penalties_follow_openai_after_the_repeat_penalty():
    """llama.cpp's order (the repetition penalty, then frequency and presence), OpenAI's formula: logit - count *
    frequency - (count > 0) * presence, count over what the Sampler drew (not the prompt); float64 oracle."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=40).astype(np.float32)
    history = [5, 9, 9, 30]                      # the prompt, for the repetition penalty
    drawn = [9, 12, 12, 12, 33]
    s = Sampler(temp=0, repeat_penalty=1.2, repeat_last_n=-1, frequency_penalty=0.7, presence_penalty=-0.4)
    want = logits.astype(np.float64).copy()
    for t in set(history):
        want[t] = want[t] / 1.2 if want[t] > 0 else want[t] * 1.2
    for t in set(drawn):
        want[t] -= drawn.count(t) * 0.7 + (-0.4)
    np.testing.assert_allclose(s.penalize(logits, history, drawn), want, rtol=1e-6)
    # the Sampler counts what it returns; reset() forgets it
    s = Sampler(temp=0, frequency_penalty=2.0)
    flat = np.zeros(4, np.float32)
    assert [s(flat) for _ in range(4)] == [0, 1, 2, 3]
    s.reset()
    assert s(flat) == 0


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [-2.01, 2.5, float("nan"), True])
def test_penalties_are_bounded(field, value):
    with pytest.raises(ValueError, match=f"{field} .* is out of range: a number between -2 and 2"):
        Sampler(**{field: value})
