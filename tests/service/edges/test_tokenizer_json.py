"""An artifact that carries a tokenizer.json: text in through it, text deltas out through it."""

import grpc
import pytest

from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc

from ..conftest import collect, start_server

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


@pytest.fixture(scope="module")
def sentencepiece_llama_artifact(tmp_path_factory, make_hf_llama):
    """A Llama artifact whose tokenizer.json is built as Llama 2's is: Metaspace ("▁" for spaces) BPE with byte
    fallback, and a post-processor that puts <s> (BOS) first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from kvserve.export.pipeline import export_artifact, load_source

    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback()])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *bytes_])
    tokenizer.train_from_iterator(CORPUS, trainer)
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    _, checkpoint = make_hf_llama(
        "llama", vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=bos, eos_token_id=eos,
    )
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    model, source = load_source(None, checkpoint)
    out = tmp_path_factory.mktemp("sentencepiece") / "artifact"
    export_artifact(model, source, out, provider="cpu", tokenizer_dir=checkpoint)
    return out, tokenizer, bos


def test_a_llama_tokenizer_puts_bos_first_and_streams_its_spaces(sentencepiece_llama_artifact):
    artifact, tokenizer, bos = sentencepiece_llama_artifact
    running = start_server(artifact)
    try:
        with grpc.insecure_channel(running.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            prompt = "the quick brown fox"
            ids = list(stub.Tokenize(pb.TokenizeRequest(text=prompt)).ids)
            assert ids[0] == bos and ids == tokenizer.encode(prompt).ids  # as transformers' tokenizer encodes it
            for seed in (1, 2):
                sampling = pb.SamplingParams(temperature=1.0, seed=seed)
                got, text, finish = collect(stub, pb.GenerateRequest(text=prompt, max_new_tokens=40, sampling=sampling, ignore_eos=True))
                assert finish.prompt_tokens == len(ids)
                # the stream reads on from the prompt: a "▁" word start keeps its space, the first one included
                assert text.startswith(" ") or not tokenizer.id_to_token(got[0]).startswith("▁")
                assert prompt + text == tokenizer.decode(ids + got, skip_special_tokens=True)
    finally:
        running.stop()
