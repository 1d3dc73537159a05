//! Diagnostics: one error type for every stage, with the span it points at.
//!
//! Following PRQL, the library returns `Error { kind, span, reason, help }`
//! and turns it into a rendered report only at the edge ([`render`]), where
//! the graph source is at hand. The library never prints.

use std::fmt;

/// A byte range in the graph file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Span {
    /// First byte.
    pub start: usize,
    /// One past the last byte.
    pub end: usize,
}

impl Span {
    /// A span from `start` to `end`.
    pub fn new(start: usize, end: usize) -> Self {
        Span { start, end }
    }

    /// The smallest span covering both.
    pub fn join(self, other: Span) -> Span {
        Span::new(self.start.min(other.start), self.end.max(other.end))
    }

    /// 1-based line and column of the span's start in `src`.
    pub fn line_col(&self, src: &str) -> (usize, usize) {
        let upto = &src[..self.start.min(src.len())];
        let line = upto.matches('\n').count() + 1;
        let col = upto.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        (line, col)
    }
}

/// What went wrong, by stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The graph file does not parse.
    Syntax,
    /// A name is unknown, duplicated or of the wrong kind.
    Name,
    /// A compile-time value has the wrong type or value.
    Value,
    /// The model config is missing a key or has a bad value.
    Config,
    /// An op's operands do not fit its shape or dtype rules.
    Shape,
    /// A block or op is called with the wrong arguments.
    Call,
    /// A `require` in the graph failed.
    Require,
    /// The graph is structurally invalid (found by the validator).
    Invalid,
    /// A size limit that protects the compiler was exceeded.
    Limit,
    /// A file could not be read.
    Io,
    /// The checkpoint does not match the graph.
    Checkpoint,
}

impl ErrorKind {
    /// A stable code for reports and tests.
    pub fn code(self) -> &'static str {
        match self {
            ErrorKind::Syntax => "mkc::syntax",
            ErrorKind::Name => "mkc::name",
            ErrorKind::Value => "mkc::value",
            ErrorKind::Config => "mkc::config",
            ErrorKind::Shape => "mkc::shape",
            ErrorKind::Call => "mkc::call",
            ErrorKind::Require => "mkc::require",
            ErrorKind::Invalid => "mkc::invalid",
            ErrorKind::Limit => "mkc::limit",
            ErrorKind::Io => "mkc::io",
            ErrorKind::Checkpoint => "mkc::checkpoint",
        }
    }
}

/// An error from any stage.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{reason}")]
pub struct Error {
    /// The stage and class of the error.
    pub kind: ErrorKind,
    /// What is wrong, in one sentence.
    pub reason: String,
    /// Where in the graph file, if the error has a place there.
    pub span: Option<Span>,
    /// The label under the span.
    pub label: Option<String>,
    /// How to fix it.
    pub help: Option<String>,
}

impl Error {
    /// An error of `kind` saying `reason`.
    pub fn new(kind: ErrorKind, reason: impl Into<String>) -> Self {
        Error { kind, reason: reason.into(), span: None, label: None, help: None }
    }

    /// Points the error at `span`.
    pub fn at(mut self, span: Span) -> Self {
        self.span = Some(span);
        self
    }

    /// Points the error at `span` unless it already points somewhere.
    pub fn or_at(mut self, span: Span) -> Self {
        if self.span.is_none() {
            self.span = Some(span);
        }
        self
    }

    /// Adds a label under the span.
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }

    /// Adds a hint.
    pub fn help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }
}

/// Shorthand for results of the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An [`Error`] joined with the graph source, as miette renders it.
#[derive(Debug)]
struct Report<'a> {
    error: &'a Error,
    source: miette::NamedSource<String>,
}

impl fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for Report<'_> {}

/// The code is not given to miette: [`render`]'s first line already carries it
/// (`error[mkc::name]: ...`), and miette would print it again on a line of its own.
impl miette::Diagnostic for Report<'_> {
    fn help<'b>(&'b self) -> Option<Box<dyn fmt::Display + 'b>> {
        self.error.help.as_ref().map(|h| Box::new(h) as Box<dyn fmt::Display>)
    }

    fn source_code(&self) -> Option<&dyn miette::SourceCode> {
        self.error.span.map(|_| &self.source as &dyn miette::SourceCode)
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = miette::LabeledSpan> + '_>> {
        let span = self.error.span?;
        let label = miette::LabeledSpan::new(self.error.label.clone(), span.start, span.end.saturating_sub(span.start));
        Some(Box::new(std::iter::once(label)))
    }
}

/// Renders `error` against the graph source, without colour, `width` columns
/// wide. The first line is `file:line:col: error[code]: reason`, so tools and
/// people find the place at a glance; the code frame follows.
pub fn render(error: &Error, file_name: &str, source: &str) -> String {
    let mut out = String::new();
    match error.span {
        Some(span) => {
            let (line, col) = span.line_col(source);
            out.push_str(&format!("{file_name}:{line}:{col}: error[{}]: {}\n", error.kind.code(), error.reason));
        }
        None => out.push_str(&format!("error[{}]: {}\n", error.kind.code(), error.reason)),
    }
    // miette cannot frame a line wider than a formatting width (it panics
    // past 65,535 columns); show such lines by their position only.
    let unframed;
    let error = match error.span {
        Some(span) if longest_line(source, span) > MAX_FRAMED_LINE => {
            unframed = Error { span: None, ..error.clone() };
            &unframed
        }
        _ => error,
    };
    let report = Report { error, source: miette::NamedSource::new(file_name, source.to_string()) };
    let handler = miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode_nocolor())
        .with_width(100)
        .with_links(false);
    let mut frame = String::new();
    if handler.render_report(&mut frame, &report).is_ok() {
        out.push_str(&without_header(&frame));
    }
    out
}

/// miette's report less its header: the reason after `×` (wrapped onto `│`
/// lines), which the first line of [`render`] already says. What is left is
/// the code frame and the help, so each error is printed once.
fn without_header(frame: &str) -> String {
    let mut lines = frame.lines().skip_while(|l| l.is_empty()).peekable();
    if lines.next_if(|l| l.starts_with("  × ")).is_some() {
        while lines.next_if(|l| l.starts_with("  │ ")).is_some() {}
    }
    let rest: Vec<&str> = lines.skip_while(|l| l.trim().is_empty()).collect();
    if rest.is_empty() {
        String::new()
    } else {
        rest.join("\n") + "\n"
    }
}

/// The widest line (in bytes) a code frame shows.
const MAX_FRAMED_LINE: usize = 4096;

/// The longest line, in bytes, that `span` touches in `source`.
fn longest_line(source: &str, span: Span) -> usize {
    let bytes = source.as_bytes();
    let (first, last) = (span.start.min(bytes.len()), span.end.clamp(span.start, bytes.len()).min(bytes.len()));
    let start = bytes[..first].iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let end = bytes[last..].iter().position(|&b| b == b'\n').map_or(bytes.len(), |i| last + i);
    bytes[start..end.max(start)].split(|&b| b == b'\n').map(<[u8]>::len).max().unwrap_or(0)
}
