import torch

from pytgi.engine.sampling.watermark import apply_watermark, green_list, z_score


def test_green_list_is_a_deterministic_half_of_the_vocabulary():
    a, b = green_list(42, 1000), green_list(42, 1000)
    assert torch.equal(a, b) and len(a) == 500 and len(set(a.tolist())) == 500
    assert not torch.equal(a, green_list(43, 1000))


def test_bias_only_on_marked_rows_and_green_tokens():
    logits = torch.zeros(3, 100)
    apply_watermark(logits, [1], [7], delta=2.0)
    assert logits[0].abs().sum() == 0 and logits[2].abs().sum() == 0
    green = set(green_list(7, 100).tolist())
    assert {i for i in range(100) if logits[1, i] == 2.0} == green


def test_watermarked_greedy_text_is_detected_and_plain_text_is_not():
    torch.manual_seed(0)
    vocab, n = 500, 80
    plain, marked = [1], [1]
    for _ in range(n):
        noise = torch.randn(1, vocab) * 0.5  # a flat-ish distribution the bias can move
        plain.append(int(noise.argmax()))
        biased = noise.clone()
        apply_watermark(biased, [0], [marked[-1]], delta=2.0)
        marked.append(int(biased.argmax()))
    assert z_score(marked, vocab) > 4
    assert abs(z_score(plain, vocab)) < 3
