#!/usr/bin/env python3
"""Prints statistics of a PNG screenshot, using only the standard library.

Usage: png_stats.py FILE.png
Prints one JSON object: width, height, distinct_colors (sampled),
luma_stddev, colored_fraction (pixels whose channels differ by more than 60,
i.e. the coloured lines and areas of graphs rather than black text on white),
and non_white_fraction. Exits 1 on a file it cannot decode.

Decodes 8-bit, non-interlaced greyscale/RGB/RGBA PNGs (what Chromium writes).
"""
import json
import struct
import sys
import zlib


def decode_png(data):
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file")
    pos, idat, header = 8, [], None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    if header is None:
        raise ValueError("no IHDR chunk")
    width, height, depth, color, _, _, interlace = header
    channels = {0: 1, 2: 3, 6: 4}.get(color)
    if depth != 8 or channels is None or interlace != 0:
        raise ValueError("unsupported PNG: depth %d colour type %d interlace %d" %
                         (depth, color, interlace))
    raw = zlib.decompress(b"".join(idat))
    stride = width * channels
    rows, prev = [], bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind = raw[start]
        line = bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up = prev[i]
            up_left = prev[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + ((left + up) >> 1)) & 0xFF
            elif kind == 4:
                p = left + up - up_left
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
                pred = left if pa <= pb and pa <= pc else (up if pb <= pc else up_left)
                line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line))
        prev = line
    return width, height, channels, rows


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        with open(sys.argv[1], "rb") as f:
            width, height, channels, rows = decode_png(f.read())
    except (OSError, ValueError, zlib.error) as e:
        print("png_stats: %s: %s" % (sys.argv[1], e), file=sys.stderr)
        return 1
    colors, lumas, colored, non_white, n = set(), [], 0, 0, 0
    for row in rows:
        for x in range(0, width, 2):
            px = row[x * channels:x * channels + 3] if channels >= 3 else row[x:x + 1] * 3
            r, g, b = px[0], px[1], px[2]
            n += 1
            colors.add((r >> 3, g >> 3, b >> 3))
            lumas.append(0.299 * r + 0.587 * g + 0.114 * b)
            if max(r, g, b) - min(r, g, b) > 60:
                colored += 1
            if min(r, g, b) < 240:
                non_white += 1
    mean = sum(lumas) / n
    stddev = (sum((v - mean) ** 2 for v in lumas) / n) ** 0.5
    print(json.dumps({
        "width": width,
        "height": height,
        "distinct_colors": len(colors),
        "luma_stddev": round(stddev, 2),
        "colored_fraction": round(colored / n, 5),
        "non_white_fraction": round(non_white / n, 5),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
