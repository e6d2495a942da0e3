//! `--open`: the browser opens the console's tokened URL without the token
//! ever being a process argument, which every local user can read
//! (`/proc/PID/cmdline`, `ps`). The URL goes into a page only its owner can
//! read; the opener is given that page's `file://` address.
//!
//! ```text
//!   console ─ writes ─▶ $XDG_RUNTIME_DIR (else the temp dir)/agentrun-console-<random>/open.html
//!                        (directory 0700, file 0600: a refresh to http://127.0.0.1:P/?token=T)
//!           ─ spawns ─▶ xdg-open | open  file:///…/open.html        (no token in its argv)
//!   browser ─ reads the page ─▶ GET /?token=T ─▶ 303 + cookie
//!   the page is removed once the token is traded for the cookie, after
//!   [`KEEP`], or when the console stops, whichever comes first
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use maud::{DOCTYPE, html};

/// How long the page waits for a browser that never reads it.
pub const KEEP: Duration = Duration::from_secs(120);

/// The page that sends the browser to the console, and the private
/// directory it is in; both go when this is dropped.
pub struct LaunchPage {
    dir: PathBuf,
    file: PathBuf,
}

impl LaunchPage {
    /// Writes the page for `url` in a new directory only this user can
    /// enter, under `base`.
    pub fn write(base: &Path, url: &str) -> std::io::Result<LaunchPage> {
        let dir = base.join(format!(
            "agentrun-console-{}",
            &super::auth::random_token()[..16]
        ));
        let mut builder = std::fs::DirBuilder::new();
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
        builder.create(&dir)?;
        let page = LaunchPage {
            file: dir.join("open.html"),
            dir,
        };
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        options
            .open(&page.file)?
            .write_all(redirect(url).as_bytes())?;
        Ok(page)
    }

    /// The page's `file://` address: what the opener is given.
    pub fn address(&self) -> String {
        format!(
            "file://{}",
            super::auth::encode(&self.file.to_string_lossy())
        )
    }
}

impl Drop for LaunchPage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.file);
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Where the page's directory goes: the user's runtime directory (a private
/// tmpfs on most Linux desktops), else the system's temporary directory.
pub fn base_dir() -> PathBuf {
    std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|d| d.is_absolute() && d.is_dir())
        .unwrap_or_else(std::env::temp_dir)
}

/// The program that opens an address in the default browser.
pub fn opener() -> &'static str {
    if cfg!(target_os = "macos") {
        "open"
    } else {
        "xdg-open"
    }
}

/// A page that sends the browser on to `url` at once (no script: a
/// refresh, and a link for a browser that does not follow it), telling no
/// one where it came from.
pub fn redirect(url: &str) -> String {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="referrer" content="no-referrer";
                meta http-equiv="refresh" content=(format!("0;url={url}"));
                title { "agentrun console" }
            }
            body { p { "Opening the agentrun console: " a href=(url) { "continue" } "." } }
        }
    }
    .into_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_sends_the_browser_to_the_url_and_no_referrer() {
        let url = "http://127.0.0.1:4011/?token=ab12";
        let page = redirect(url);
        assert!(
            page.contains(
                r#"<meta http-equiv="refresh" content="0;url=http://127.0.0.1:4011/?token=ab12">"#
            ),
            "{page}"
        );
        assert!(page.contains(r#"<meta name="referrer" content="no-referrer">"#));
        assert!(page.contains(r#"<a href="http://127.0.0.1:4011/?token=ab12">"#));
        assert!(!page.contains("<script"));
        // Markup in a URL stays text.
        assert!(redirect("http://x/?a=\"><script>").contains("&quot;&gt;&lt;script&gt;"));
    }

    #[cfg(unix)]
    #[test]
    fn the_page_is_its_owners_alone_and_goes_when_dropped() {
        use std::os::unix::fs::PermissionsExt;
        let base = std::env::temp_dir();
        let page = LaunchPage::write(&base, "http://127.0.0.1:1/?token=secret").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&page.dir), 0o700);
        assert_eq!(mode(&page.file), 0o600);
        let address = page.address();
        assert!(address.starts_with("file:///"), "{address}");
        assert!(address.ends_with("/open.html"), "{address}");
        assert!(!address.contains("secret"), "{address}");
        let text = std::fs::read_to_string(&page.file).unwrap();
        assert!(text.contains("?token=secret"), "{text}");
        let (dir, file) = (page.dir.clone(), page.file.clone());
        drop(page);
        assert!(!file.exists() && !dir.exists());
    }
}
