"""An organizer uploads a dataset in Chromium: chunked, resumed after a failed chunk and a reload, then sharded."""

from __future__ import annotations

from pathlib import Path

from playwright.sync_api import Page, Route, expect

from crowdtrain.campaigns.models import Dataset, Upload
from tests.browser.live_site import Shot, log_in
from tests.factories import make_organizer

CHUNK = 8 << 20  # the site's default CROWDTRAIN_UPLOAD_CHUNK_BYTES


def test_an_upload_cut_short_resumes_after_a_reload_and_is_sharded(page: Page, shot: Shot, tmp_path: Path) -> None:
    make_organizer("olga")
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes((b"The quick brown fox jumps over the lazy dog. " * 250_000)[: CHUNK + 1_500_000])
    log_in(page, "olga@example.org")

    # The second chunk is refused on the way: the uploader stops and says why.
    def refuse_later_chunks(route: Route) -> None:
        if "offset=0" in route.request.url:
            route.continue_()
        else:
            route.fulfill(status=400, content_type="application/json", body='{"error": "simulated network trouble"}')

    page.route("**/chunk?offset=*", refuse_later_chunks)
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
