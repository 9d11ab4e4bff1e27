"""An artifact that carries a tokenizer.json: text in through it, text deltas out through it."""

import grpc
import pytest

from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc

from .conftest import collect, start_server

CORPUS = ["héllo wörld, the quick brown fox — 日本語のテキスト 🙂", "kvserve streams tokens over gRPC"] * 50


@pytest.fixture(scope="module")
def bpe_artifact(tmp_path_factory, make_hf_checkpoint):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    vocab = tokenizer.get_vocab_size()
    eos = tokenizer.token_to_id("<|endoftext|>")
    _, checkpoint = make_hf_checkpoint(vocab_size=vocab, n_positions=128, n_embd=32, n_head=2, n_layer=2, eos_token_id=eos, bos_token_id=eos)
    tokenizer.save(str(checkpoint / "tokenizer.json"))

    from kvserve.export.pipeline import export_artifact, load_source

    model, source = load_source(None, checkpoint)
    out = tmp_path_factory.mktemp("bpe") / "artifact"
    export_artifact(model, source, out, provider="cpu", tokenizer_dir=checkpoint)
    return out, tokenizer


def test_text_goes_through_the_artifacts_tokenizer_and_deltas_are_whole_characters(bpe_artifact):
    artifact, tokenizer = bpe_artifact
    running = start_server(artifact)
    try:
        with grpc.insecure_channel(running.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest())
            assert info.tokenizer == "tokenizer.json"
            prompt = "héllo wörld 日本"
            assert list(stub.Tokenize(pb.TokenizeRequest(text=prompt)).ids) == tokenizer.encode(prompt).ids
            for seed in (1, 2, 3):
                sampling = pb.SamplingParams(temperature=1.0, seed=seed)  # random tokens: split characters galore
                ids, text, finish = collect(stub, pb.GenerateRequest(text=prompt, max_new_tokens=40, sampling=sampling, ignore_eos=True))
                assert finish.prompt_tokens == len(tokenizer.encode(prompt).ids)
                assert text == tokenizer.decode(ids, skip_special_tokens=True)
    finally:
        running.stop()
