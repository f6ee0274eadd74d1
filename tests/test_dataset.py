"""The corpus' token files: files encoded a chunk at a time give exactly the ids of encoding them one by one,
each followed by the EOS token, and the split by path hash puts every file on one side."""

import numpy as np
import pytest

from specjax import default_models
from specjax.config import DataConfig
from specjax.data.corpus import read_texts
from specjax.data import dataset
from specjax.data.dataset import prepare, split_files


@pytest.mark.parametrize("files", [3, 10])  # one chunk of 4 files, and three
def test_token_files_equal_one_file_at_a_time_with_eos_between(tmp_path, files, monkeypatch):
    monkeypatch.setattr(dataset, "TOKENIZE_CHUNK", 4)  # 256 in use: chunks of 4 test the same joins in less time
    config = DataConfig(max_files=files + 4, held_out_fraction=0.1, tokenizer=str(
        default_models.tokenizer_folder(default_models.TARGET)))
    tokenizer, train, held_out = prepare(config, tmp_path)
    _, train_files, held_out_files = split_files(config)
    for tokens, paths in ((train, train_files), (held_out, held_out_files)):
        expected = []
        for text in read_texts(paths):
            expected += tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(expected, np.uint32))
    assert not set(train_files) & set(held_out_files)
