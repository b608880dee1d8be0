//! JSON-lines input for bulk commands (`enqueue --batch`): read in chunks, parse each line,
//! submit the good ones, and answer every input line with one output line.
//!
//! Output rule: line N of the output answers line N of the input — the result (an id), or
//! an empty line for a blank or bad line, whose reason goes to stderr as `line N: …`. Good
//! lines are submitted whatever the bad ones; the exit code is 2 when any line was bad. A
//! progress spinner shows on a terminal (stderr).

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{BufRead, Write};

/// Lines read (and submitted) per chunk.
const CHUNK: usize = 10_000;

/// Reads `path` ("-" = stdin); `parse` turns a line into an item or says why it is bad;
/// `submit` handles one chunk's items and answers each (`Ok(output)` or `Err(why)`).
pub async fn run<T>(
    path: &str,
    what: &str,
    parse: impl Fn(&str) -> Result<T, String>,
    mut submit: impl AsyncFnMut(Vec<T>) -> anyhow::Result<Vec<Result<String, String>>>,
) -> anyhow::Result<i32> {
    let reader: Box<dyn BufRead> = if path == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        Box::new(std::io::BufReader::new(
            std::fs::File::open(path).with_context(|| format!("cannot open --batch {path}"))?,
        ))
    };
    let progress = ProgressBar::new_spinner();
    progress.set_style(
        ProgressStyle::with_template(&format!("{{spinner}} {{pos}} {what} ({{per_sec}}) {{msg}}"))
            .expect("a valid template"),
    );
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut bad = 0usize;
    let mut lines = reader.lines().enumerate().peekable();
    while lines.peek().is_some() {
        // (line number, parsed item or why it is bad; "" for a blank line)
        let mut chunk: Vec<(usize, Result<T, String>)> = Vec::with_capacity(CHUNK);
        for (i, line) in lines.by_ref().take(CHUNK) {
            let line = line.context("reading --batch input")?;
            let parsed = if line.trim().is_empty() {
                Err(String::new())
            } else {
                parse(&line)
            };
            chunk.push((i + 1, parsed));
        }
        let mut numbers = Vec::with_capacity(chunk.len());
        let mut items = Vec::with_capacity(chunk.len());
        let mut answers: Vec<Option<Result<String, String>>> = Vec::with_capacity(chunk.len());
        for (number, parsed) in chunk {
            numbers.push(number);
            match parsed {
                Ok(item) => {
                    items.push(item);
                    answers.push(None);
                }
                Err(why) => answers.push(Some(Err(why))),
            }
        }
        let mut submitted = submit(items).await?.into_iter();
        for (number, answer) in numbers.into_iter().zip(answers) {
            let answer = answer.unwrap_or_else(|| {
                submitted
                    .next()
                    .expect("submit answers every item it was given")
            });
            match answer {
                Ok(result) => writeln!(out, "{result}")?,
                Err(why) if why.is_empty() => writeln!(out)?,
                Err(why) => {
                    bad += 1;
                    writeln!(out)?;
                    progress.suspend(|| eprintln!("line {number}: {why}"));
                }
            }
            progress.inc(1);
        }
        out.flush()?;
    }
    progress.finish_and_clear();
    if bad > 0 {
        eprintln!("{bad} bad lines were not submitted; the others were");
        return Ok(2);
    }
    Ok(0)
}
