#!/usr/bin/env python3
"""Writes token shards for train_gpt (--data) from text files.

  prepare_tokens.py [--tokenizer byte|gpt2] [--gpt2-files DIR] [--format llmc|u16]
                    [--shard-tokens N] [--val-tokens N] --out PREFIX TEXT...

The text files are read in the order given, one document each, into one token stream:
- byte (the default): each byte is a token (vocabulary 256; train_gpt --vocab 256);
- gpt2: GPT-2's byte-pair encoding through tiktoken, each document after the end-of-text token
  50256 (as llm.c's data scripts write it; train_gpt --vocab 50257). It needs the `tiktoken`
  package and GPT-2's two encoding files, vocab.bpe and encoder.json, in the folder --gpt2-files
  names (default: $WEFT_GPT2_FILES). Nothing is downloaded here: docs/train_gpt.md ("Data") says
  where to get the files once.

The first --val-tokens tokens (default 0) go to PREFIX_val_000000.bin, the rest to
PREFIX_train_000000.bin, PREFIX_train_000001.bin, ... of at most --shard-tokens tokens each.
--format llmc (the default) writes llm.c's shards: a header of 256 little-endian int32 (magic
20240520, version 1, the token count, then zeros) and the tokens as little-endian uint16;
--format u16 writes nanoGPT's headerless uint16 .bin. Prints each file written and its tokens.
"""
import argparse
import array
import os
import sys

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256
GPT2_END_OF_TEXT = 50256
# GPT-2's pre-tokenizer pattern and special token, as tiktoken defines its "gpt2" encoding.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def gpt2_encoder(folder):
    """tiktoken's GPT-2 encoding built from local files only (never fetched)."""
    try:
        import tiktoken
        import tiktoken.load
    except ImportError:
        sys.exit("prepare_tokens: --tokenizer gpt2 needs the tiktoken package (pip install tiktoken); "
                 "or use the default byte-level tokenizer")
    if not folder:
        sys.exit("prepare_tokens: --tokenizer gpt2 needs GPT-2's vocab.bpe and encoder.json in a folder: give it with "
                 "--gpt2-files DIR or WEFT_GPT2_FILES (docs/train_gpt.md, \"Data\", says where to get them)")
    files = [os.path.join(folder, name) for name in ("vocab.bpe", "encoder.json")]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        sys.exit(f"prepare_tokens: {', '.join(missing)} not found: put GPT-2's vocab.bpe and encoder.json in "
                 f"'{folder}' (docs/train_gpt.md, \"Data\"); nothing is downloaded here")
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=files[0], encoder_json_file=files[1])
    encoding = tiktoken.Encoding(name="gpt2", explicit_n_vocab=50257, pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": GPT2_END_OF_TEXT})
    return lambda text: [GPT2_END_OF_TEXT] + encoding.encode_ordinary(text)


def write_shard(path, tokens, fmt):
    body = array.array("H", tokens)
    if sys.byteorder != "little":
        body.byteswap()
    with open(path, "wb") as f:
        if fmt == "llmc":
            header = array.array("i", [MAGIC, VERSION, len(tokens)] + [0] * (HEADER_INTS - 3))
            if sys.byteorder != "little":
                header.byteswap()
            f.write(header.tobytes())
        f.write(body.tobytes())
    print(f"{path}: {len(tokens)} tokens")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", choices=("byte", "gpt2"), default="byte")
    parser.add_argument("--gpt2-files", default=os.environ.get("WEFT_GPT2_FILES", ""))
    parser.add_argument("--format", choices=("llmc", "u16"), default="llmc")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000)
    parser.add_argument("--val-tokens", type=int, default=0)
    parser.add_argument("--out", required=True, help="the shards' path prefix")
    parser.add_argument("text", nargs="+")
    args = parser.parse_args()
    if args.shard_tokens < 1 or args.val_tokens < 0:
        sys.exit("prepare_tokens: --shard-tokens must be at least 1 and --val-tokens at least 0")
    encode = gpt2_encoder(args.gpt2_files) if args.tokenizer == "gpt2" else None
    stream = []
    for path in args.text:
        if encode is None:
            with open(path, "rb") as f:
                stream.extend(f.read())
        else:
            with open(path, encoding="utf-8") as f:
                stream.extend(encode(f.read()))
    if len(stream) <= args.val_tokens:
        sys.exit(f"prepare_tokens: the text holds {len(stream)} tokens, not more than --val-tokens {args.val_tokens}")
    if os.path.dirname(args.out):
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
    if args.val_tokens > 0:
        write_shard(f"{args.out}_val_000000.bin", stream[:args.val_tokens], args.format)
    train = stream[args.val_tokens:]
    for i, at in enumerate(range(0, len(train), args.shard_tokens)):
        write_shard(f"{args.out}_train_{i:06d}.bin", train[at:at + args.shard_tokens], args.format)
    return 0


if __name__ == "__main__":
    sys.exit(main())
