#!/usr/bin/env python3
"""Turns the English text Debian's `fortunes` package ships (/usr/share/games/fortunes, about 2.5 MB
of quotations, jokes and poems; `make deps` installs it) into the character-level corpus
examples/gpt_train and bench/peers/torch_gpt.py read with --data:

  train [n] U8, val [m] U8    token ids: each byte's index in `vocab`
  vocab [V] U8                the distinct bytes of the whole text, ascending

Each fortune (the text between two "%" lines) keeps its trailing "%\\n", so the model sees where one
ends. Every 20th fortune of each file goes to `val`, the held-out split no rank trains on: whole
fortunes, so no quotation is half in each split. The file order is sorted and the split fixed, so
every run, world size and program sees the same tokens. ascii-art is left out (drawings, not text).
Written by hand (a JSON header and raw bytes): no safetensors package needed.

  text_to_safetensors.py OUT.safetensors [DIR]
"""
import json
import os
import struct
import sys

SKIP = {"ascii-art"}
HELD_OUT_EVERY = 20


def fortunes(directory):
    """(file, fortune bytes) in a fixed order: the files strfile indexed (a .dat beside them)."""
    names = sorted(f for f in os.listdir(directory)
                   if f not in SKIP and os.path.isfile(os.path.join(directory, f)) and os.path.exists(os.path.join(directory, f + ".dat")))
    if not names:
        sys.exit(f"text_to_safetensors: no fortune files in {directory} (apt-get install fortunes)")
    for name in names:
        with open(os.path.join(directory, name), "rb") as f:
            raw = f.read()
        for piece in raw.split(b"\n%\n"):
            piece = piece.strip(b"\n%")
            if piece:
                yield name, piece + b"\n%\n"


def write_safetensors(path, tensors, metadata):
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name, blob in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(blob)], "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    os.replace(path + ".tmp", path)  # make never sees half a file


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: text_to_safetensors.py OUT.safetensors [DIR]")
    directory = sys.argv[2] if len(sys.argv) == 3 else "/usr/share/games/fortunes"
    train, val = bytearray(), bytearray()
    count = {}
    for name, text in fortunes(directory):
        i = count.get(name, 0)
        count[name] = i + 1
        (val if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).extend(text)
    vocab = bytes(sorted(set(train) | set(val)))
    index = bytes.maketrans(vocab, bytes(range(len(vocab))))
    write_safetensors(sys.argv[1], {"train": bytes(train).translate(index), "val": bytes(val).translate(index), "vocab": vocab},
                      {"source": directory, "split": f"every {HELD_OUT_EVERY}th fortune of each file held out", "files": str(len(count))})
    print(f"text: {len(count)} fortune files, {len(train)} training and {len(val)} held-out characters, "
          f"vocabulary {len(vocab)} -> {sys.argv[1]}")


if __name__ == "__main__":
    main()
