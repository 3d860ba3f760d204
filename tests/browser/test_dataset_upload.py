"""An organizer uploads a dataset in Chromium: chunked, resumed after a failed chunk and a reload, then sharded."""

from __future__ import annotations

import json
from pathlib import Path

from playwright.sync_api import Page, Route, expect

from crowdtrain.datasets.models import Dataset, Upload
from tests.browser.live_site import Shot, log_in
from tests.factories import make_organizer

CHUNK = 8 << 20  # the site's default CROWDTRAIN_UPLOAD_CHUNK_BYTES


def _refuse_chunks_after_the_first(page: Page, error: str) -> None:
    """The first chunk goes through, the others are refused with ``error``, as by a network in trouble."""

    def refuse(route: Route) -> None:
        if "offset=0" in route.request.url:
            route.continue_()
        else:
            route.fulfill(status=400, content_type="application/json", body=json.dumps({"error": error}))

    page.route("**/chunk?offset=*", refuse)


def test_an_upload_cut_short_resumes_after_a_reload_and_is_sharded(page: Page, shot: Shot, tmp_path: Path) -> None:
    make_organizer("olga")
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes((b"The quick brown fox jumps over the lazy dog. " * 250_000)[: CHUNK + 1_500_000])
    log_in(page, "olga@example.org")

    # The second chunk is refused on the way: the uploader stops and says why.
    _refuse_chunks_after_the_first(page, "simulated network trouble")
    page.goto("/datasets/new")
    page.get_by_label("File").set_input_files(corpus)
    page.get_by_label("Name").fill("fox corpus")
    page.get_by_role("button", name="Upload").click()
    expect(page.get_by_role("alert")).to_have_text("simulated network trouble")
    shot(page, "upload stopped")
    assert Upload.objects.get().received == CHUNK

    # After a reload, the same file goes on from the site's resume point.
    page.unroute("**/chunk?offset=*")
    page.reload()
    sent: list[str] = []
    page.on("request", lambda request: sent.append(request.url.split("?")[1]) if "/chunk?" in request.url else None)
    page.get_by_label("File").set_input_files(corpus)
    page.get_by_label("Name").fill("fox corpus")
    page.get_by_role("button", name="Upload").click()
    expect(page.locator("[data-dataset-status] [data-field=status]")).to_have_text("ready", timeout=60_000)
    assert sent == [f"offset={CHUNK}"], "the resumed upload sent bytes the site already had"
    shot(page, "dataset ready")

    dataset = Dataset.objects.get(name="fox corpus")
    assert Upload.objects.count() == 1
    assert dataset.num_samples + dataset.num_validation_samples == (CHUNK + 1_500_000) // 65
    expect(page.locator("[data-field=num_samples]")).to_have_text(str(dataset.num_samples))


def test_a_bad_jsonl_file_shows_its_line_number_on_the_dataset_page(page: Page, shot: Shot, tmp_path: Path) -> None:
    make_organizer("olga")
    bad = tmp_path / "records.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken}\n')
    log_in(page, "olga@example.org")

    page.goto("/datasets/new")
    page.get_by_label("File").set_input_files(bad)
    expect(page.get_by_label("Format")).to_have_value("jsonl")
    page.get_by_role("button", name="Upload").click()

    expect(page.locator("[data-dataset-status] [data-field=status]")).to_have_text("failed")
    expect(page.get_by_role("alert")).to_contain_text("line 2 is not valid JSON")
    shot(page, "bad jsonl")


def test_the_dataset_list_shows_an_unfinished_upload_and_a_ready_dataset(
    page: Page, shot: Shot, tmp_path: Path
) -> None:
    olga = make_organizer("olga")
    Upload.objects.create(owner=olga, name="big", filename="big.txt", size=5 << 30, format="text", sample_len=65,
                          received=1 << 30)  # fmt: skip
    small = tmp_path / "small.txt"
    small.write_bytes(b"to be or not to be, that is the question. " * 100)
    log_in(page, "olga@example.org")

    page.goto("/datasets/new")
    page.get_by_label("File").set_input_files(small)
    page.get_by_label("Sample length (bytes)").fill("9")
    page.get_by_role("button", name="Upload").click()
    expect(page.locator("[data-dataset-status] [data-field=status]")).to_have_text("ready")
    page.get_by_role("link", name="My datasets").click()

    expect(page.get_by_role("row", name="small")).to_contain_text("Ready")
    expect(page.get_by_text("big.txt")).to_be_visible()
    shot(page, "dataset list")


def test_a_text_tokenized_on_upload_shows_its_stages_and_its_tokenizer(page: Page, shot: Shot, tmp_path: Path) -> None:
    make_organizer("olga")
    corpus = tmp_path / "poems.txt"
    corpus.write_bytes(b"Shall I compare thee to a summer's day? Thou art more lovely and more temperate.\n" * 3000)
    log_in(page, "olga@example.org")

    page.goto("/datasets/new")
    page.get_by_label("File").set_input_files(corpus)
    page.get_by_label("Tokenizer", exact=True).select_option("train")
    page.get_by_label("Vocabulary size").fill("300")
    expect(page.get_by_label("Sample length (tokens)")).to_be_visible()
    page.get_by_label("Sample length (tokens)").fill("17")
    page.get_by_role("button", name="Upload").click()

    expect(page.locator("[data-dataset-status] [data-field=status]")).to_have_text("ready", timeout=60_000)
    expect(page.locator("[data-field=tokenizer]")).to_contain_text("300 tokens")
    shot(page, "tokenized dataset")
    dataset = Dataset.objects.get(name="poems")
    assert (dataset.kind, dataset.vocab_size, dataset.sample_len) == ("tokens", 300, 17)
    expect(page.locator("[data-field=num_samples]")).to_have_text(str(dataset.num_samples))


def test_an_organizers_tokenizer_file_is_checked_before_the_upload_starts(
    page: Page, shot: Shot, tmp_path: Path
) -> None:
    make_organizer("olga")
    corpus = tmp_path / "notes.txt"
    corpus.write_bytes(b"some notes to tokenize " * 200)
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"version": "1.0", "model": {"type": "nothing"}}')
    log_in(page, "olga@example.org")

    page.goto("/datasets/new")
    page.get_by_label("File").set_input_files(corpus)
    page.get_by_label("Tokenizer", exact=True).select_option("file")
    page.get_by_label("Your tokenizer.json").set_input_files(broken)
    page.get_by_role("button", name="Upload").click()

    expect(page.get_by_role("alert")).to_contain_text("not a tokenizer.json the tokenizers library reads")
    shot(page, "tokenizer refused")
    assert not Upload.objects.exists()


def test_an_image_archive_lists_the_files_it_skipped(page: Page, shot: Shot, tmp_path: Path) -> None:
    import io
    import zipfile

    from PIL import Image

    make_organizer("olga")
    archive = tmp_path / "pets.zip"
    with zipfile.ZipFile(archive, "w") as pets:
        for label, colour in (("cat", (200, 30, 30)), ("dog", (30, 30, 200))):
            for i in range(6):
                picture = io.BytesIO()
                Image.new("RGB", (24, 20), colour).save(picture, format="PNG")
                pets.writestr(f"{label}/{i}.png", picture.getvalue())
        pets.writestr("cat/shopping-list.txt", b"milk, eggs")
    log_in(page, "olga@example.org")

    page.goto("/datasets/new")
    page.get_by_label("File").set_input_files(archive)
    expect(page.get_by_label("Format")).to_have_value("images")
    page.get_by_label("Image size (pixels)").fill("16")
    page.get_by_role("button", name="Upload").click()

    expect(page.locator("[data-dataset-status] [data-field=status]")).to_have_text("ready", timeout=60_000)
    skipped = page.locator("[data-skipped]")
    expect(skipped).to_contain_text("1 file skipped")
    skipped.locator("summary").click()
    expect(skipped).to_contain_text("cat/shopping-list.txt")
    expect(page.get_by_text("2 classes: cat, dog")).to_be_visible()
    shot(page, "image dataset")


def test_the_same_file_with_another_sample_length_is_a_new_upload_not_the_old_one_resumed(
    page: Page, shot: Shot, tmp_path: Path
) -> None:
    make_organizer("olga")
    corpus = tmp_path / "fox.txt"
    corpus.write_bytes((b"The quick brown fox jumps over the lazy dog. " * 250_000)[: CHUNK + 100_000])
    log_in(page, "olga@example.org")

    # An upload with samples of 17 bytes stops after its first chunk.
    _refuse_chunks_after_the_first(page, "simulated trouble")
    page.goto("/datasets/new")
    page.get_by_label("File").set_input_files(corpus)
    page.get_by_label("Name").fill("fox 17")
    page.get_by_label("Sample length (bytes)").fill("17")
    page.get_by_role("button", name="Upload").click()
    expect(page.get_by_role("alert")).to_have_text("simulated trouble")

    # The same file with samples of 33 bytes: a dataset of 33-byte samples, sent from the start.
    page.unroute("**/chunk?offset=*")
    page.reload()
    page.get_by_label("File").set_input_files(corpus)
    page.get_by_label("Name").fill("fox 33")
    page.get_by_label("Sample length (bytes)").fill("33")
    page.get_by_role("button", name="Upload").click()
    expect(page.locator("[data-dataset-status] [data-field=status]")).to_have_text("ready", timeout=60_000)
    shot(page, "the same file as a new upload")

    assert Upload.objects.count() == 2
    assert list(Dataset.objects.values_list("name", "sample_len")) == [("fox 33", 33)]
