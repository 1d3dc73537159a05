//! A strict JSON reader for safetensors headers and index files.
//!
//! The runtime's reader (`runtime/src/json.hpp`) is a line-by-line
//! translation of this one, so the compiler's checker and the runtime refuse
//! the same files with the same messages (`tests/fixtures/hostile_checkpoints`
//! holds the cases both are run over). serde_json is not used here: it takes
//! the later of two equal keys and its messages are its own.
//!
//! The rules, beyond RFC 8259: the text must be UTF-8; an object may not
//! repeat a key; a `\u` escape of a high surrogate must be followed by one of
//! a low surrogate (the pair is one character), and a lone surrogate is
//! refused; arrays and objects nest at most [`MAX_DEPTH`] deep. Numbers keep
//! their text; [`Value::as_u64`] accepts a plain non-negative integer that
//! fits in 64 bits and nothing else. Every error ends `at byte N`, the offset
//! in the text. Not handled: anything those two files do not need (no
//! floating-point values, no writer).

use std::collections::BTreeMap;

/// Deepest nesting of arrays and objects accepted (a header needs 3).
pub const MAX_DEPTH: usize = 64;

/// A JSON value. Objects are ordered by key bytes, as the runtime's are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// `null`.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// A number, as written.
    Number(String),
    /// A string.
    String(String),
    /// An array.
    Array(Vec<Value>),
    /// An object.
    Object(BTreeMap<String, Value>),
}

impl Value {
    /// The value as a 64-bit unsigned integer, or what is wrong with it
    /// (`is negative`, `is not an integer`, `is too large`, `is not a number`).
    pub fn as_u64(&self) -> Result<u64, &'static str> {
        let Value::Number(text) = self else { return Err("is not a number") };
        if text.starts_with('-') {
            Err("is negative")
        } else if text.contains(['.', 'e', 'E']) {
            Err("is not an integer")
        } else {
            text.parse().map_err(|_| "is too large")
        }
    }
}

/// Parses `bytes` as one JSON value.
pub fn parse(bytes: &[u8]) -> Result<Value, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8 at byte {}", e.valid_up_to()))?;
    let mut p = Parser { s: text.as_bytes(), i: 0 };
    let v = p.value(1)?;
    p.ws();
    if p.i != p.s.len() {
        return Err(p.fail("trailing characters"));
    }
    Ok(v)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn fail(&self, what: &str) -> String {
        format!("{what} at byte {}", self.i)
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\n' | b'\r' | b'\t')) {
            self.i += 1;
        }
    }

    fn value(&mut self, depth: usize) -> Result<Value, String> {
        self.ws();
        match self.peek() {
            None => Err(self.fail("unexpected end")),
            Some(b'{' | b'[') if depth > MAX_DEPTH => Err(self.fail("nesting deeper than 64")),
            Some(b'{') => self.object(depth),
            Some(b'[') => self.array(depth),
            Some(b'"') => self.string().map(Value::String),
            Some(b't') => self.literal("true", Value::Bool(true)),
            Some(b'f') => self.literal("false", Value::Bool(false)),
            Some(b'n') => self.literal("null", Value::Null),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => Err(self.fail("unexpected character")),
        }
    }

    fn literal(&mut self, word: &str, v: Value) -> Result<Value, String> {
        if !self.s[self.i..].starts_with(word.as_bytes()) {
            return Err(self.fail("unexpected character"));
        }
        self.i += word.len();
        Ok(v)
    }

    fn object(&mut self, depth: usize) -> Result<Value, String> {
        self.i += 1;
        let mut map = BTreeMap::new();
        self.ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
            return Ok(Value::Object(map));
        }
        loop {
            self.ws();
            if self.peek() != Some(b'"') {
                return Err(self.fail("expected a string key"));
            }
            let at = self.i;
            let key = self.string()?;
            if map.contains_key(&key) {
                return Err(format!("duplicate key \"{key}\" at byte {at}"));
            }
            self.ws();
            if self.peek() != Some(b':') {
                return Err(self.fail("expected ':'"));
            }
            self.i += 1;
            let v = self.value(depth + 1)?;
            map.insert(key, v);
            self.ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    self.i += 1;
                    return Ok(Value::Object(map));
                }
                _ => return Err(self.fail("expected ',' or '}'")),
            }
        }
    }

    fn array(&mut self, depth: usize) -> Result<Value, String> {
        self.i += 1;
        let mut items = Vec::new();
        self.ws();
        if self.peek() == Some(b']') {
            self.i += 1;
            return Ok(Value::Array(items));
        }
        loop {
            items.push(self.value(depth + 1)?);
            self.ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Ok(Value::Array(items));
                }
                _ => return Err(self.fail("expected ',' or ']'")),
            }
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.i;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.i += 1;
        }
        self.i - start
    }

    fn number(&mut self) -> Result<Value, String> {
        let start = self.i;
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        if self.peek() == Some(b'0') {
            self.i += 1;
        } else if self.digits() == 0 {
            return Err(self.fail("bad number"));
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            if self.digits() == 0 {
                return Err(self.fail("bad number"));
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if self.digits() == 0 {
                return Err(self.fail("bad number"));
            }
        }
        // The text is ASCII digits and signs: always UTF-8.
        Ok(Value::Number(String::from_utf8_lossy(&self.s[start..self.i]).into_owned()))
    }

    fn hex4(&mut self) -> Result<u32, String> {
        let mut v = 0;
        for _ in 0..4 {
            let d = match self.peek() {
                Some(c @ b'0'..=b'9') => c - b'0',
                Some(c @ b'a'..=b'f') => c - b'a' + 10,
                Some(c @ b'A'..=b'F') => c - b'A' + 10,
                _ => return Err(self.fail("bad \\u escape")),
            };
            v = v * 16 + u32::from(d);
            self.i += 1;
        }
        Ok(v)
    }

    fn string(&mut self) -> Result<String, String> {
        self.i += 1;
        let mut out = Vec::new();
        loop {
            let Some(c) = self.peek() else { return Err(self.fail("unterminated string")) };
            self.i += 1;
            match c {
                b'"' => break,
                b'\\' => self.escape(&mut out)?,
                0..=0x1f => {
                    self.i -= 1;
                    return Err(self.fail("control character in a string"));
                }
                _ => out.push(c),
            }
        }
        // Bytes copied from UTF-8 text and whole characters from escapes.
        String::from_utf8(out).map_err(|_| self.fail("not UTF-8"))
    }

    fn escape(&mut self, out: &mut Vec<u8>) -> Result<(), String> {
        let Some(e) = self.peek() else { return Err(self.fail("unterminated string")) };
        self.i += 1;
        let byte = match e {
            b'"' => b'"',
            b'\\' => b'\\',
            b'/' => b'/',
            b'b' => 0x08,
            b'f' => 0x0c,
            b'n' => b'\n',
            b'r' => b'\r',
            b't' => b'\t',
            b'u' => {
                let at = self.i - 2;
                let mut cp = self.hex4()?;
                if (0xDC00..0xE000).contains(&cp) {
                    return Err(format!("lone surrogate at byte {at}"));
                }
                if (0xD800..0xDC00).contains(&cp) {
                    if !self.s[self.i..].starts_with(b"\\u") {
                        return Err(format!("lone surrogate at byte {at}"));
                    }
                    self.i += 2;
                    let low = self.hex4()?;
                    if !(0xDC00..0xE000).contains(&low) {
                        return Err(format!("lone surrogate at byte {at}"));
                    }
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
                }
                let c = char::from_u32(cp).ok_or_else(|| self.fail("bad \\u escape"))?;
                out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
                return Ok(());
            }
            _ => {
                self.i -= 1;
                return Err(self.fail("bad escape"));
            }
        };
        out.push(byte);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn surrogate_pairs_are_one_character_and_lone_ones_are_refused() {
        assert_eq!(parse(br#""\ud83d\ude00""#), Ok(Value::String("\u{1F600}".into())));
        assert_eq!(parse(br#""\ud83d""#), Err("lone surrogate at byte 1".into()));
        assert_eq!(parse(br#""\ude00\ud83d""#), Err("lone surrogate at byte 1".into()));
        assert_eq!(parse(br#""\ud83dx""#), Err("lone surrogate at byte 1".into()));
    }

    #[test]
    fn integers_are_plain_and_fit_64_bits() {
        let n = |t: &str| parse(t.as_bytes()).unwrap().as_u64();
        assert_eq!(n("18446744073709551615"), Ok(u64::MAX));
        assert_eq!(n("18446744073709551616"), Err("is too large"));
        assert_eq!(n("-512"), Err("is negative"));
        assert_eq!(n("-0"), Err("is negative"));
        assert_eq!(n("2.0"), Err("is not an integer"));
        assert_eq!(n("2e3"), Err("is not an integer"));
        assert_eq!(parse(b"01"), Err("trailing characters at byte 1".into()));
    }

    #[test]
    fn keys_repeat_nowhere_and_nesting_is_bounded() {
        assert_eq!(parse(br#"{"a":1,"a":2}"#), Err("duplicate key \"a\" at byte 7".into()));
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert!(parse(deep(64).as_bytes()).is_ok());
        assert_eq!(parse(deep(65).as_bytes()), Err("nesting deeper than 64 at byte 64".into()));
        assert_eq!(parse(b"\"\xff\""), Err("not UTF-8 at byte 1".into()));
    }
}
