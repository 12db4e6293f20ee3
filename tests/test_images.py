"""Image inputs at the image-module level: sources, the URL policy, decoding, and a zoo of
bad images, each of which must come back as its own fault (never an exception)."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from PIL import Image

from assets.images import bomb_png, draw_shape, encode
from dagster_gpuinfer.image_options import ImageOptions
from dagster_gpuinfer.spec import StorageOptions
from dagster_gpuinfer.worker.tasks.images import (
    DecodedImage,
    ImageDecoder,
    ImageFault,
    ImageSource,
    chat_image_parts,
    decode_image,
)

PNG = encode(draw_shape("circle", "red", (80, 60), seed=1))
JPEG = encode(draw_shape("square", "blue", (120, 90), seed=2), "JPEG", quality=90)


def fault_of(decoder: ImageDecoder, ref, base_uri: str | None = None) -> str:
    [result] = decoder.load_all([ref], base_uri)
    assert isinstance(result, ImageFault), f"expected a fault for {ref!r:.80}, got {result}"
    return result.error_type


@pytest.fixture
def decoder() -> Iterator[ImageDecoder]:
    decoder = ImageDecoder(ImageOptions(max_side=256, decode_threads=2))
    yield decoder
    decoder.close()


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/circle.png":
            self.send_response(200)
            self.end_headers()
            self.wfile.write(PNG)
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
            self.end_headers()
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def image_server() -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 serving one image, a redirect and 404s."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_binary_png_and_jpeg_decode_to_rgb(decoder):
    png, jpeg = decoder.load_all([PNG, JPEG])
    assert isinstance(png, DecodedImage) and png.image.mode == "RGB"
    assert png.image.size == (80, 60) and png.encoded_bytes == len(PNG)
    assert isinstance(jpeg, DecodedImage) and jpeg.image.size == (120, 90)


def test_datasets_struct_and_data_uri(decoder):
    uri = "data:image/png;base64," + base64.b64encode(PNG).decode()
    from_struct, from_uri = decoder.load_all([{"bytes": PNG, "path": "x.png"}, uri])
    assert from_struct.image.tobytes() == from_uri.image.tobytes()


def test_large_image_is_fitted_keeping_its_aspect(decoder):
    big = encode(draw_shape("stripes", "green", (1000, 500)))
    [result] = decoder.load_all([big])
    assert result.image.size == (256, 128) and result.original_size == (1000, 500)


def test_exif_orientation_is_applied(decoder):
    image = draw_shape("triangle", "red", (100, 40))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    data = encode(image, "JPEG", exif=exif.tobytes())
    [result] = decoder.load_all([data])
    assert result.image.size == (40, 100)


def test_transparency_over_white_and_grey_to_rgb(decoder):
    clear = Image.new("RGBA", (10, 10), (0, 0, 0, 0))
    grey = Image.new("L", (10, 10), 90)
    a, b = decoder.load_all([encode(clear), encode(grey)])
    assert a.image.mode == "RGB" and a.image.getpixel((5, 5)) == (255, 255, 255)
    assert b.image.getpixel((5, 5)) == (90, 90, 90)


# ---------------------------------------------------------------------------- the zoo


def test_zoo_undecodable_truncated_bomb(decoder):
    assert fault_of(decoder, b"definitely not an image") == "image_undecodable"
    assert fault_of(decoder, JPEG[: len(JPEG) // 2]) == "image_truncated"
    assert fault_of(decoder, PNG[: len(PNG) - 40]) in ("image_truncated", "image_undecodable")
    # Pillow's own limit (twice MAX_IMAGE_PIXELS) and ours, both from the header alone.
    assert fault_of(decoder, bomb_png(100_000, 100_000)) == "image_bomb"
    small_limit = ImageDecoder(ImageOptions(max_image_pixels=1000))
    assert fault_of(small_limit, bomb_png(100, 100)) == "image_bomb"


def test_zoo_too_large_for_the_model_when_refused():
    refusing = ImageDecoder(ImageOptions(max_side=64, oversize="refuse"))
    assert fault_of(refusing, PNG) == "image_too_large"
    assert isinstance(refusing.load_all([encode(Image.new("RGB", (64, 10)))])[0], DecodedImage)


def test_zoo_too_many_bytes_and_empty(decoder):
    tight = ImageDecoder(ImageOptions(max_image_bytes=100))
    assert fault_of(tight, PNG) == "image_too_big"
    assert fault_of(tight, "data:image/png;base64," + base64.b64encode(PNG).decode()) == (
        "image_too_big"
    )
    assert fault_of(decoder, None) == "no_image"
    assert fault_of(decoder, b"") == "no_image"
    assert fault_of(decoder, 12) == "no_image"
    assert fault_of(decoder, "data:image/png;base64,@@@") == "image_undecodable"


def test_zoo_too_many_images_in_one_request():
    decoder = ImageDecoder(ImageOptions(max_images_per_request=2))
    one, three, bad = decoder.load_groups([[PNG], [PNG, PNG, PNG], [PNG, b"junk"]])
    assert [i.image.size for i in one] == [(80, 60)]
    assert isinstance(three, ImageFault) and three.error_type == "too_many_images"
    assert "limit_mm_per_prompt" in three.message
    assert isinstance(bad, ImageFault) and bad.error_type == "image_undecodable"


def test_zoo_missing_file_and_paths_outside_the_shard(decoder, tmp_path):
    shard = tmp_path / "shards" / "part-0.parquet"
    (tmp_path / "shards" / "img").mkdir(parents=True)
    (tmp_path / "shards" / "img" / "a.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    ok, missing, escape = decoder.load_all(
        ["img/a.png", "img/none.png", "../secret.png"], str(shard)
    )
    assert isinstance(ok, DecodedImage)
    assert missing.error_type == "image_missing" and "img/none.png" in missing.message
    assert escape.error_type == "image_url_refused"
    assert fault_of(decoder, str(tmp_path / "secret.png")) == "image_url_refused"
    assert fault_of(decoder, "file:///etc/passwd") == "image_url_refused"
    rooted = ImageDecoder(ImageOptions(local_roots=(str(tmp_path),)))
    assert isinstance(rooted.load_all([str(tmp_path / "secret.png")])[0], DecodedImage)


def test_zoo_disallowed_schemes(decoder):
    for ref in ("ftp://example.com/a.png", "gs://bucket/a.png", "javascript:alert(1)"):
        assert fault_of(decoder, ref, "/data/shard.parquet") == "image_url_refused", ref


def test_loopback_url_refused_unless_allow_listed(image_server):
    url = f"http://{image_server}/circle.png"
    default = ImageDecoder(ImageOptions())
    fault = default.load_all([url])[0]
    assert fault.error_type == "image_url_refused" and "allowed_url_hosts" in fault.message
    assert fault_of(default, "http://127.0.0.1/latest/meta-data/") == "image_url_refused"
    allowed = ImageDecoder(ImageOptions(allowed_url_hosts=(image_server,)))
    fetched, gone, redirected = allowed.load_all(
        [url, f"http://{image_server}/nope.png", f"http://{image_server}/moved"]
    )
    assert isinstance(fetched, DecodedImage) and fetched.image.size == (80, 60)
    assert gone.error_type == "image_missing"
    assert redirected.error_type == "image_fetch_failed"  # redirects are never followed


def test_s3_image_and_missing_key(s3_server, decoder):
    bucket = s3_server.new_bucket("images")
    s3_server.client.put_object(Bucket=bucket, Key="shards/img/a.png", Body=PNG)
    storage = StorageOptions(
        endpoint_url=s3_server.endpoint_url, region=s3_server.region, allow_http=True
    )
    s3 = ImageDecoder(ImageOptions(), storage)
    shard = f"s3://{bucket}/shards/part-0.parquet"
    absolute, relative, missing = s3.load_all(
        [f"s3://{bucket}/shards/img/a.png", "img/a.png", f"s3://{bucket}/shards/img/b.png"], shard
    )
    assert isinstance(absolute, DecodedImage) and isinstance(relative, DecodedImage)
    assert missing.error_type == "image_missing" and "b.png" in missing.message


def test_chat_image_parts_become_placeholders():
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what shape?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "image_url", "image_url": "img/b.png"},
            ],
        },
    ]
    rendered, urls = chat_image_parts(messages)
    assert urls == ["data:image/png;base64,AAAA", "img/b.png"]
    assert rendered[1]["content"][1:] == [{"type": "image"}, {"type": "image"}]
    assert rendered[0] == messages[0]
    with pytest.raises(ImageFault):
        chat_image_parts([{"role": "user", "content": [{"type": "image_url"}]}])


def test_image_source_never_reads_refused_urls():
    class Recording:
        opened: list[str] = []

        def open(self, url, timeout):
            self.opened.append(url)
            return io.BytesIO(PNG)

    opener = Recording()
    source = ImageSource(ImageOptions(allowed_url_hosts=("images.example.com",)), opener=opener)
    assert source.read("https://images.example.com/a.png") == PNG
    for url in ("http://127.0.0.1/a", "http://[::1]/a", "http://images.example.com.evil/a"):
        with pytest.raises(ImageFault):
            source.read(url)
    assert opener.opened == ["https://images.example.com/a.png"]


# ---------------------------------------------------------------------------- hostile hosts


class _Trickle(http.server.BaseHTTPRequestHandler):
    """Answers every GET slowly: `/body` sends its headers, then one byte every 0.1 s of a
    body it says is 100 kB long; `/headers` trickles its header lines themselves. Each stops
    after 8 s at most, so the fetch of today's code (a timeout per socket read) ends too."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        stop = time.monotonic() + 8
        try:
            if self.path == "/headers":
                self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                while time.monotonic() < stop:
                    self.wfile.write(b"X-Slow: 1\r\n")
                    self.wfile.flush()
                    time.sleep(0.1)
                return
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            while time.monotonic() < stop:
                self.wfile.write(b"\0")
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:  # the client gave up: what the test wants
            pass

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def trickle_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("path", ["/body", "/headers"])
def test_a_slow_allowed_host_is_cut_off_at_the_fetch_timeout_for_the_whole_download(
    trickle_server, path
):
    options = ImageOptions(allowed_url_hosts=(trickle_server,), fetch_timeout_seconds=1.0)
    decoder = ImageDecoder(options)
    started = time.monotonic()
    [fault] = decoder.load_all([f"http://{trickle_server}{path}"])
    elapsed = time.monotonic() - started
    decoder.close()
    assert isinstance(fault, ImageFault), fault
    assert fault.error_type == "image_fetch_failed", fault.message
    assert "images.fetch_timeout_seconds=1.0" in fault.message, fault.message
    assert elapsed < 3.0, f"the fetch took {elapsed:.1f} s against a 1 s bound"


def _recording_source(hosts: tuple[str, ...]) -> tuple[ImageSource, list[str]]:
    opened: list[str] = []

    class Recording:
        def open(self, url, timeout):
            opened.append(url)
            return io.BytesIO(PNG)

    return ImageSource(ImageOptions(allowed_url_hosts=hosts), opener=Recording()), opened


def test_a_host_listed_without_a_port_allows_only_its_schemes_default_port():
    source, opened = _recording_source(("images.example.com", "cdn.example.com:8443"))
    allowed = [
        "https://images.example.com/a.png",
        "http://images.example.com/a.png",
        "https://images.example.com:443/a.png",
        "http://images.example.com:80/a.png",
        "https://cdn.example.com:8443/a.png",
    ]
    for url in allowed:
        assert source.read(url) == PNG, url
    refused = [
        "https://images.example.com:6379/a.png",
        "http://images.example.com:8080/a.png",
        "http://images.example.com:443/a.png",
        "https://cdn.example.com/a.png",
        "https://cdn.example.com:8444/a.png",
    ]
    for url in refused:
        with pytest.raises(ImageFault) as info:
            source.read(url)
        assert info.value.error_type == "image_url_refused", url
        assert "allowed_url_hosts" in info.value.message
    assert opened == allowed


def test_a_port_in_the_allow_list_must_be_a_port():
    with pytest.raises(ValueError, match="not a host name"):
        ImageOptions(allowed_url_hosts=("images.example.com:http",))


def test_a_listed_name_that_resolves_to_loopback_is_refused_after_resolving(image_server):
    port = image_server.rsplit(":", 1)[1]
    decoder = ImageDecoder(ImageOptions(allowed_url_hosts=(f"localhost:{port}",)))
    [fault] = decoder.load_all([f"http://localhost:{port}/circle.png"])
    decoder.close()
    assert isinstance(fault, ImageFault), "a name resolving to 127.0.0.1 was fetched"
    assert fault.error_type == "image_url_refused", fault.message
    assert "127.0.0.1" in fault.message and "localhost" in fault.message


@pytest.mark.parametrize(
    "address", ["127.0.0.1", "169.254.169.254", "10.0.0.7", "::1", "::ffff:127.0.0.1", "fd00::1"]
)
def test_a_listed_name_rebound_to_an_internal_address_is_never_connected(monkeypatch, address):
    import socket

    real = socket.getaddrinfo
    connected: list[object] = []

    def rebinding(host, port, *args, **kwargs):
        if host == "images.example.com":
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sockaddr = (address, port, 0, 0) if ":" in address else (address, port)
            return [(family, socket.SOCK_STREAM, 6, "", sockaddr)]
        return real(host, port, *args, **kwargs)

    original_connect = socket.socket.connect

    def recording_connect(self, sockaddr):
        connected.append(sockaddr)
        return original_connect(self, sockaddr)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    monkeypatch.setattr(socket.socket, "connect", recording_connect)
    source = ImageSource(
        ImageOptions(allowed_url_hosts=("images.example.com",), fetch_timeout_seconds=2.0)
    )
    with pytest.raises(ImageFault) as info:
        source.read("http://images.example.com/a.png")
    assert info.value.error_type == "image_url_refused", info.value.message
    assert address in info.value.message
    assert connected == [], "the worker connected to an internal address"


def test_a_symlink_in_the_shards_folder_is_not_followed_out_of_it(decoder, tmp_path):
    shards = tmp_path / "shards"
    (shards / "img").mkdir(parents=True)
    (tmp_path / "secret.png").write_bytes(PNG)
    (shards / "img" / "inside.png").write_bytes(PNG)
    (shards / "img" / "out.png").symlink_to(tmp_path / "secret.png")
    (shards / "outdir").symlink_to(tmp_path)
    (shards / "img" / "alias.png").symlink_to(shards / "img" / "inside.png")
    shard = str(shards / "part-0.parquet")
    refs = ["img/out.png", "outdir/secret.png", "img/alias.png"]
    out, out_dir, alias = decoder.load_all(refs, shard)
    assert isinstance(out, ImageFault) and out.error_type == "image_url_refused", out
    assert "shard's folder" in out.message
    assert isinstance(out_dir, ImageFault) and out_dir.error_type == "image_url_refused"
    assert isinstance(alias, DecodedImage)  # a link that stays inside is fine


# ---------------------------------------------------------------------------- properties


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_any_bytes_give_an_image_or_a_fault(data):
    result = decode_or_fault(data)
    assert isinstance(result, DecodedImage | ImageFault)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, len(PNG) + len(JPEG) - 1))
def test_any_truncation_or_corruption_gives_an_image_or_a_fault(cut):
    source = PNG if cut < len(PNG) else JPEG
    cut = cut % len(source)
    for data in (source[:cut], source[:cut] + bytes([source[cut] ^ 0xFF]) + source[cut + 1 :]):
        assert isinstance(decode_or_fault(data), DecodedImage | ImageFault)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 700),
    st.integers(1, 700),
    st.sampled_from(["RGB", "RGBA", "L", "P", "1", "CMYK"]),
    st.sampled_from(["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"]),
)
def test_any_valid_image_decodes_to_rgb_within_max_side(width, height, mode, image_format):
    image = Image.new(mode, (width, height))
    if image_format == "JPEG" and mode in ("RGBA", "P"):
        image = image.convert("RGB")
    try:
        data = encode(image, image_format)
    except (OSError, ValueError):  # a mode the format cannot store (CMYK as PNG, GIF)
        assume(False)
    result = decode_image(data, ImageOptions(max_side=256))
    assert result.image.mode == "RGB"
    assert max(result.image.size) <= 256
    assert result.original_size == (width, height)


_DECODER = ImageDecoder(ImageOptions(max_side=256, max_image_pixels=4_000_000, decode_threads=1))


def decode_or_fault(data: bytes):
    return _DECODER.load_all([data])[0]


# ---------------------------------------------------------------------------- the validator

_ROW_KINDS = {
    "image": (PNG, None),
    "jpeg": (JPEG, None),
    "text": (None, "a red circle"),
    "junk": (b"junk", None),
    "truncated": (JPEG[: len(JPEG) // 2], None),
    "both": (PNG, "a caption"),
    "neither": (None, None),
    "empty_text": (None, "   "),
    "two": ([PNG, JPEG], None),
    "refused": ("http://127.0.0.1/x.png", None),
}


@pytest.fixture(scope="module")
def clip_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from assets.models import make_tiny_clip

    return AutoTokenizer.from_pretrained(make_tiny_clip(tmp_path_factory.mktemp("clip") / "m"))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.sampled_from(sorted(_ROW_KINDS)), min_size=1, max_size=12))
def test_every_image_embed_row_is_a_prompt_or_its_own_error(clip_tokenizer, kinds):
    from dagster_gpuinfer.worker.rows.readers import RawChunk
    from dagster_gpuinfer.worker.rows.validate import RowValidator

    rows = [(i, f"r{i}-{kind}", _ROW_KINDS[kind]) for i, kind in enumerate(kinds)]
    validator = RowValidator(task="image_embed", tokenizer=clip_tokenizer, max_model_len=77)
    try:
        chunk = RawChunk(index=0, source="s.parquet", rows=rows, rows_in=len(rows))
        out = validator.validate(chunk)
    finally:
        validator.close()
    errored = {e.id: e.error_type for e in out.errors}
    assert len(out.ids) + len(errored) == len(rows)  # every row in exactly one place
    assert set(out.ids).isdisjoint(errored)
    assert len(out.images) == len(out.token_ids) == len(out.ids)
    for row_id, images in zip(out.ids, out.images, strict=True):
        kind = row_id.split("-", 1)[1]
        assert kind in ("image", "jpeg", "text")
        assert (len(images) == 1) == (kind != "text")
    expected = {
        "junk": "image_undecodable",
        "truncated": "image_truncated",
        "both": "image_and_text",
        "neither": "no_image",
        "empty_text": "no_image",
        "two": "too_many_images",
        "refused": "image_url_refused",
    }
    for row_id, error_type in errored.items():
        assert error_type == expected[row_id.split("-", 1)[1]]
    # Images the rows carried, refused ones too (a row with an image and a text is refused
    # before its image counts).
    assert out.image_count == sum(len(_refs_of(k)) for k in kinds if k != "both")


def _refs_of(kind: str) -> list:
    image = _ROW_KINDS[kind][0]
    return [] if image is None else image if isinstance(image, list) else [image]
