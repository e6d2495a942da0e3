//! The commands, each a function of the parsed arguments and a client, a
//! file each; what more than one of them uses is here.

pub mod console;
pub mod decide;
pub mod describe;
pub mod history;
pub mod list;
pub mod logs;
pub mod pending;
pub mod retry;
pub mod signal;
pub mod steer;
pub mod submit;
pub mod watch;

use std::io::{BufRead, IsTerminal, Write};

use clap::ValueEnum;

use crate::client::Error;
use crate::render::Style;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Output {
    Json,
    Yaml,
}

pub(crate) fn style() -> Style {
    Style {
        color: std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none(),
    }
}

pub(crate) fn print_as<T: serde::Serialize>(o: Output, v: &T) -> Result<(), Error> {
    let text = match o {
        Output::Json => serde_json::to_string_pretty(v).map_err(|e| Error::Usage(e.to_string()))?,
        Output::Yaml => serde_yaml::to_string(v).map_err(|e| Error::Usage(e.to_string()))?,
    };
    println!("{}", text.trim_end());
    Ok(())
}

pub(crate) fn confirm(yes: bool, prompt: &str) -> Result<(), Error> {
    if yes {
        return Ok(());
    }
    if !std::io::stdin().is_terminal() {
        return Err(Error::Usage(format!(
            "{prompt} Not a terminal: confirm with --yes"
        )));
    }
    print!("{prompt} [y/N] ");
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    if matches!(line.trim(), "y" | "Y" | "yes") {
        Ok(())
    } else {
        Err(Error::Refused("not confirmed; nothing was changed".into()))
    }
}
