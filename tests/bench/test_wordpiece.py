from inshrinkerator.bench.workloads.bert import minilm_files
from inshrinkerator.bench.workloads.wordpiece import WordPieceTokenizer


def test_splits_words_into_vocabulary_pieces() -> None:
    tokenizer = WordPieceTokenizer(minilm_files()[2])
    ids = tokenizer.encode("Tokenizers split words, don't they?", 64)
    vocab = {index: token for token, index in tokenizer.vocab.items()}
    pieces = [vocab[i] for i in ids]
    assert pieces[0] == "[CLS]" and pieces[-1] == "[SEP]"
    assert "," in pieces and "'" in pieces and "?" in pieces
    assert any(p.startswith("##") for p in pieces)  # "tokenizers" is not one piece
    assert "".join(p.removeprefix("##") for p in pieces[1:3]).startswith("token")


def test_truncates_to_max_length() -> None:
    tokenizer = WordPieceTokenizer(minilm_files()[2])
    ids = tokenizer.encode("word " * 100, 10)
    assert len(ids) == 10 and ids[-1] == tokenizer.sep_id
