"""bench perplexity cuts the token stream as llama-perplexity does."""

from bench.perplexity import chunks


def test_chunks_are_whole_runs_of_ctx_tokens_with_bos_first_where_the_model_adds_it():
    ids = list(range(100, 100 + 2 * 8 + 5))  # two whole chunks of 8, then 5 left over
    assert chunks(ids, 8, None) == [ids[:8], ids[8:16]]
    assert chunks(ids, 8, 1) == [[1] + ids[1:8], [1] + ids[9:16]]
    assert chunks(ids[:7], 8, None) == []
