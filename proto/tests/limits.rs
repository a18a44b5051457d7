//! The helpers that keep a peer's strings within `kmm_proto::limits`.

use kmm_proto::limits::{KERNEL_RELEASE, truncate, truncated, valid_kernel_release};

#[test]
fn kernel_releases_as_distributions_name_them_are_valid_and_junk_is_not() {
    for release in [
        "6.1.0-13-amd64",
        "5.14.0-362.8.1.el9_3.x86_64",
        "6.1.21-v8+",
        "5.15.0-1051-azure",
        "4.18.0-305.el8.x86_64+debug",
    ] {
        assert!(valid_kernel_release(release), "{release}");
    }
    let longest = "6".repeat(KERNEL_RELEASE);
    assert!(valid_kernel_release(&longest));
    for junk in [
        "",
        "6.1 amd64",
        "../../etc",
        "6.1\n",
        "ünïcode",
        &"6".repeat(KERNEL_RELEASE + 1),
    ] {
        assert!(!valid_kernel_release(junk), "{junk:?}");
    }
}

#[test]
fn truncation_keeps_whole_chars() {
    assert_eq!(truncated("short", 10), "short");
    assert_eq!(truncated("abcdef", 3), "abc");
    // "é" is two bytes: a cut in its middle keeps what precedes it.
    assert_eq!(truncated("aé", 2), "a");
    assert_eq!(truncated("ééé", 0), "");
    let mut text = "😀😀".to_owned();
    truncate(&mut text, 5);
    assert_eq!(text, "😀");
}

#[test]
fn a_cut_text_holds_no_more_than_it_keeps() {
    let mut text = "x".repeat(1 << 20);
    truncate(&mut text, 16);
    assert_eq!(text.len(), 16);
    assert!(text.capacity() < 1 << 10, "{}", text.capacity());
}
