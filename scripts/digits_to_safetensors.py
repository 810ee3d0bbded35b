#!/usr/bin/env python3
"""Converts scikit-learn's handwritten digits (python3-sklearn ships them: 1,797 8x8 images, 10
classes) into the safetensors file the example trainer reads with --data:

  x [1437, 64], y [1437, 10]            training rows: pixels / 16, one-hot labels (float32)
  x_test [360, 64], y_test [360, 10]    the held-out 20%, stratified by class, never trained on

The split is fixed (random_state 0), so every run and every world size sees the same rows.
Written by hand (a JSON header and raw little-endian bytes): no safetensors package needed.
"""
import json
import struct
import sys

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def write_safetensors(path, tensors, metadata):
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name, arr in tensors.items():
        blob = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: digits_to_safetensors.py OUT.safetensors")
    digits = load_digits()
    x = digits.data.astype(np.float32) / 16.0  # pixel intensities 0..16 -> 0..1
    labels = digits.target.astype(np.int64)
    x_tr, x_te, l_tr, l_te = train_test_split(x, labels, test_size=0.2, random_state=0, stratify=labels)
    eye = np.eye(10, dtype=np.float32)
    write_safetensors(sys.argv[1], {"x": x_tr, "y": eye[l_tr], "x_test": x_te, "y_test": eye[l_te]},
                      {"source": "sklearn.datasets.load_digits", "split": "train_test_split(test_size=0.2, random_state=0, stratify)"})
    print(f"digits: {len(x_tr)} training rows, {len(x_te)} held-out rows -> {sys.argv[1]}")


if __name__ == "__main__":
    main()
