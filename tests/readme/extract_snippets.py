#!/usr/bin/env python3
"""Writes the README's snippets out as source files, so that ctest builds and runs them as written.

  extract_snippets.py README.md OUTDIR NAME...

A snippet is a ```cpp (NAME.cpp) or ```python (NAME.py) block right after a line
`<!-- snippet NAME [options] -->`. Each NAME asked
for must be there exactly once (the build fails naming it otherwise), and every snippet in the
README must be asked for: a snippet nobody compiles is a snippet that rots. A file is rewritten
only when its text changed, so editing the prose rebuilds nothing.
"""
import os
import re
import sys

PATTERN = re.compile(r"^<!-- snippet (\S+)[^>]*-->\n```(cpp|python)\n(.*?)^```", re.S | re.M)
EXTENSION = {"cpp": (".cpp", "//"), "python": (".py", "#")}


def main():
    readme, outdir, wanted = sys.argv[1], sys.argv[2], sys.argv[3:]
    with open(readme) as f:
        found = {}
        for m in PATTERN.finditer(f.read()):
            if m.group(1) in found:
                sys.exit(f"{readme}: snippet '{m.group(1)}' appears twice")
            found[m.group(1)] = (m.group(2), m.group(3))
    missing = [n for n in wanted if n not in found]
    extra = [n for n in found if n not in wanted]
    if missing or extra:
        sys.exit(f"{readme}: snippets missing: {missing or 'none'}; not built by tests/CMakeLists.txt: {extra or 'none'}")
    os.makedirs(outdir, exist_ok=True)
    for name in wanted:
        lang, body = found[name]
        ext, comment = EXTENSION[lang]
        path = os.path.join(outdir, name + ext)
        text = f"{comment} Extracted from {readme} by tests/readme/extract_snippets.py: edit the README, not this file.\n" + body
        if not os.path.exists(path) or open(path).read() != text:
            with open(path, "w") as f:
                f.write(text)


if __name__ == "__main__":
    main()
