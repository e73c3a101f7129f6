//! Validate stage of `doctor` (pure, no IO): the part of CEL that DRA device selectors use,
//! evaluated over one device's published attributes and capacity as the scheduler's allocator
//! evaluates it.
//!
//! What is evaluated, with Kubernetes' semantics:
//!
//! - `device.driver`, `device.attributes["<domain>"].<name>` and
//!   `device.capacity["<domain>"].<name>`; a domain the device does not publish reads as an
//!   empty map (as in Kubernetes), a missing name is the runtime error "no such key" (which
//!   fails the scheduler's allocation of the claim, so it is reported, never taken as false).
//! - Literals (string, int, double, bool, null, lists), `== != < <= > >=`, `&& || !`, `+ - * /
//!   %` on ints, `in` (list, map key), `? :`, `has(x.y)`, `size`.
//! - Kubernetes' quantity library: `quantity(s)`, `isQuantity(s)`, `q.compareTo(q)`,
//!   `isGreaterThan`, `isLessThan`, `sign`, `isInteger`, `asInteger`, `asApproximateFloat`,
//!   `add`, `sub`. Its semver library: `semver(s)`, `isSemver(s)`, `v.compareTo(v)`,
//!   `isGreaterThan`, `isLessThan`, `major`, `minor`, `patch` (version attributes are semvers).
//! - Strings: `startsWith`, `endsWith`, `contains`, `lowerAscii`, `upperAscii`, `size`.
//!
//! Anything else (regular expressions, the `all`/`exists`/`map` macros, other functions) is
//! [`Error::Unsupported`]: the caller says "not evaluated" instead of guessing.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fmt;

/// Why an expression has no boolean value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// The scheduler's evaluation fails too (a missing attribute, a type mismatch): it refuses
    /// the claim with a CEL runtime error.
    Runtime(String),
    /// Outside the subset this evaluator knows; the scheduler's result is not known.
    Unsupported(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Runtime(m) => write!(f, "CEL runtime error: {m}"),
            Error::Unsupported(m) => write!(f, "not evaluated: {m}"),
        }
    }
}

type Result<T> = std::result::Result<T, Error>;

fn runtime<T>(message: impl Into<String>) -> Result<T> {
    Err(Error::Runtime(message.into()))
}

fn unsupported<T>(message: impl Into<String>) -> Result<T> {
    Err(Error::Unsupported(message.into()))
}

/// A Kubernetes quantity, exactly, in units of 10^-9 (the finest a quantity keeps).
#[derive(Clone, Debug)]
pub struct Quantity {
    nanos: i128,
    text: String,
}

impl PartialEq for Quantity {
    fn eq(&self, other: &Self) -> bool {
        self.nanos == other.nanos
    }
}

impl Quantity {
    /// Parses `1.5Gi`, `40536Mi`, `100m`, `2e3`; `None` for anything else.
    pub fn parse(text: &str) -> Option<Quantity> {
        let t = text.trim();
        let (sign, rest) = match t.strip_prefix('-') {
            Some(r) => (-1, r),
            None => (1, t.strip_prefix('+').unwrap_or(t)),
        };
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, suffix) = rest.split_at(end);
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if whole.is_empty() && fraction.is_empty() {
            return None;
        }
        let digits = format!("{whole}{fraction}");
        let mut value: i128 = if digits.is_empty() {
            0
        } else {
            digits.parse().ok()?
        };
        // value * 10^exp10 * 2^exp2 / 10^fraction.len(), in nanos (10^9).
        let (exp10, exp2): (i32, u32) = match suffix {
            "" => (0, 0),
            "Ki" => (0, 10),
            "Mi" => (0, 20),
            "Gi" => (0, 30),
            "Ti" => (0, 40),
            "Pi" => (0, 50),
            "Ei" => (0, 60),
            "n" => (-9, 0),
            "u" => (-6, 0),
            "m" => (-3, 0),
            "k" => (3, 0),
            "M" => (6, 0),
            "G" => (9, 0),
            "T" => (12, 0),
            "P" => (15, 0),
            "E" => (18, 0),
            s if s.starts_with(['e', 'E']) => (s[1..].parse().ok()?, 0),
            _ => return None,
        };
        let fraction_len = i32::try_from(fraction.len()).ok()?;
        let scale = 9 + exp10 - fraction_len;
        value = value.checked_mul(1i128.checked_shl(exp2)?)?;
        if scale >= 0 {
            value = value.checked_mul(10i128.checked_pow(u32::try_from(scale).ok()?)?)?;
        } else {
            // Below a nano a quantity rounds up, as Kubernetes' does.
            let d = 10i128.checked_pow(u32::try_from(-scale).ok()?)?;
            value = (value + d - 1) / d;
        }
        Some(Quantity {
            nanos: sign * value,
            text: t.to_owned(),
        })
    }

    fn from_nanos(nanos: i128) -> Quantity {
        let text = if nanos % 1_000_000_000 == 0 {
            (nanos / 1_000_000_000).to_string()
        } else {
            format!("{nanos}n")
        };
        Quantity { nanos, text }
    }
}

/// A semantic version (`580.95.5`, `1.2.3-rc.1+build`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Version {
    major: u64,
    minor: u64,
    patch: u64,
    pre: Vec<String>,
    text: String,
}

impl Version {
    /// A strict semver (three numbers), as DRA's version attributes and `semver()` take.
    pub fn parse(text: &str) -> Option<Version> {
        let core_pre = text.split('+').next()?;
        let (core, pre) = match core_pre.split_once('-') {
            Some((c, p)) => (c, p.split('.').map(str::to_owned).collect()),
            None => (core_pre, Vec::new()),
        };
        let mut parts = core.split('.');
        let number = |p: Option<&str>| -> Option<u64> {
            let p = p?;
            if p.is_empty() || (p.len() > 1 && p.starts_with('0')) {
                return None;
            }
            p.parse().ok()
        };
        let v = Version {
            major: number(parts.next())?,
            minor: number(parts.next())?,
            patch: number(parts.next())?,
            pre,
            text: text.to_owned(),
        };
        parts.next().is_none().then_some(v)
    }
}

impl Ord for Version {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.major, self.minor, self.patch)
            .cmp(&(other.major, other.minor, other.patch))
            .then_with(|| match (self.pre.is_empty(), other.pre.is_empty()) {
                (true, true) => Ordering::Equal,
                (true, false) => Ordering::Greater,
                (false, true) => Ordering::Less,
                (false, false) => {
                    for (a, b) in self.pre.iter().zip(&other.pre) {
                        let o = match (a.parse::<u64>(), b.parse::<u64>()) {
                            (Ok(x), Ok(y)) => x.cmp(&y),
                            (Ok(_), Err(_)) => Ordering::Less,
                            (Err(_), Ok(_)) => Ordering::Greater,
                            _ => a.cmp(b),
                        };
                        if o != Ordering::Equal {
                            return o;
                        }
                    }
                    self.pre.len().cmp(&other.pre.len())
                }
            })
    }
}

impl PartialOrd for Version {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// A CEL value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    Double(f64),
    String(String),
    Quantity(Quantity),
    Version(Version),
    List(Vec<Value>),
    Map(BTreeMap<String, Value>),
    /// `device.attributes` and `device.capacity`: an unknown domain reads as an empty map.
    Domains(BTreeMap<String, Value>),
}

impl Value {
    fn type_name(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Double(_) => "double",
            Value::String(_) => "string",
            Value::Quantity(_) => "Quantity",
            Value::Version(_) => "Semver",
            Value::List(_) => "list",
            Value::Map(_) | Value::Domains(_) => "map",
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Null => f.write_str("null"),
            Value::Bool(b) => write!(f, "{b}"),
            Value::Int(i) => write!(f, "{i}"),
            Value::Double(d) => write!(f, "{d}"),
            Value::String(s) => write!(f, "{s:?}"),
            Value::Quantity(q) => f.write_str(&q.text),
            Value::Version(v) => f.write_str(&v.text),
            Value::List(l) => {
                let items: Vec<String> = l.iter().map(ToString::to_string).collect();
                write!(f, "[{}]", items.join(", "))
            }
            Value::Map(_) | Value::Domains(_) => f.write_str("{...}"),
        }
    }
}

/// A parsed expression.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    Literal(Value),
    Ident(String),
    List(Vec<Expr>),
    Member(Box<Expr>, String),
    Index(Box<Expr>, Box<Expr>),
    Call {
        target: Option<Box<Expr>>,
        name: String,
        args: Vec<Expr>,
    },
    Unary(&'static str, Box<Expr>),
    Binary(&'static str, Box<Expr>, Box<Expr>),
    Conditional(Box<Expr>, Box<Expr>, Box<Expr>),
}

#[derive(Clone, Debug, PartialEq)]
enum Token {
    Ident(String),
    Int(i64),
    Double(f64),
    Str(String),
    Op(&'static str),
}

const OPERATORS: [&str; 22] = [
    "==", "!=", "<=", ">=", "&&", "||", "<", ">", "!", "+", "-", "*", "/", "%", "?", ":", ".", ",",
    "(", ")", "[", "]",
];

fn tokens(src: &str) -> Result<Vec<Token>> {
    let chars: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push(Token::Ident(chars[start..i].iter().collect()));
        } else if c.is_ascii_digit() {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_digit() || chars[i] == '.') {
                // `1.size()` is not a double: a dot must be followed by a digit.
                if chars[i] == '.' && !chars.get(i + 1).is_some_and(char::is_ascii_digit) {
                    break;
                }
                i += 1;
            }
            let text: String = chars[start..i].iter().collect();
            if chars.get(i) == Some(&'u') {
                i += 1;
            }
            out.push(if text.contains('.') {
                Token::Double(
                    text.parse()
                        .map_err(|_| Error::Unsupported(format!("number {text}")))?,
                )
            } else {
                Token::Int(
                    text.parse()
                        .map_err(|_| Error::Unsupported(format!("number {text}")))?,
                )
            });
        } else if c == '\'' || c == '"' {
            if chars.get(i + 1) == Some(&c) && chars.get(i + 2) == Some(&c) {
                return unsupported("triple-quoted strings");
            }
            let mut s = String::new();
            i += 1;
            loop {
                match chars.get(i) {
                    None => return unsupported("an unterminated string"),
                    Some(&q) if q == c => break,
                    Some('\\') => {
                        let e = chars.get(i + 1).copied().unwrap_or('\\');
                        s.push(match e {
                            'n' => '\n',
                            't' => '\t',
                            '\\' | '\'' | '"' => e,
                            _ => return unsupported(format!("the string escape \\{e}")),
                        });
                        i += 2;
                    }
                    Some(&ch) => {
                        s.push(ch);
                        i += 1;
                    }
                }
            }
            i += 1;
            out.push(Token::Str(s));
        } else {
            let rest: String = chars[i..chars.len().min(i + 2)].iter().collect();
            let op = OPERATORS
                .iter()
                .find(|op| rest.starts_with(**op))
                .ok_or_else(|| Error::Unsupported(format!("the character {c:?}")))?;
            i += op.chars().count();
            out.push(Token::Op(op));
        }
    }
    Ok(out)
}

struct Parser {
    tokens: Vec<Token>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.at)
    }

    fn eat(&mut self, op: &str) -> bool {
        if matches!(self.peek(), Some(Token::Op(o)) if *o == op) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, op: &str) -> Result<()> {
        if self.eat(op) {
            Ok(())
        } else {
            unsupported(format!(
                "syntax this evaluator does not parse: expected {op:?}"
            ))
        }
    }

    fn expr(&mut self) -> Result<Expr> {
        let cond = self.or()?;
        if self.eat("?") {
            let a = self.expr()?;
            self.expect(":")?;
            let b = self.expr()?;
            return Ok(Expr::Conditional(Box::new(cond), Box::new(a), Box::new(b)));
        }
        Ok(cond)
    }

    fn or(&mut self) -> Result<Expr> {
        let mut left = self.and()?;
        while self.eat("||") {
            left = Expr::Binary("||", Box::new(left), Box::new(self.and()?));
        }
        Ok(left)
    }

    fn and(&mut self) -> Result<Expr> {
        let mut left = self.relation()?;
        while self.eat("&&") {
            left = Expr::Binary("&&", Box::new(left), Box::new(self.relation()?));
        }
        Ok(left)
    }

    fn relation(&mut self) -> Result<Expr> {
        let mut left = self.sum()?;
        loop {
            let op = match self.peek() {
                Some(Token::Op(o)) if ["==", "!=", "<", "<=", ">", ">="].contains(o) => *o,
                Some(Token::Ident(i)) if i == "in" => "in",
                _ => return Ok(left),
            };
            self.at += 1;
            left = Expr::Binary(op, Box::new(left), Box::new(self.sum()?));
        }
    }

    fn sum(&mut self) -> Result<Expr> {
        let mut left = self.product()?;
        loop {
            let op = match self.peek() {
                Some(Token::Op(o)) if ["+", "-"].contains(o) => *o,
                _ => return Ok(left),
            };
            self.at += 1;
            left = Expr::Binary(op, Box::new(left), Box::new(self.product()?));
        }
    }

    fn product(&mut self) -> Result<Expr> {
        let mut left = self.unary()?;
        loop {
            let op = match self.peek() {
                Some(Token::Op(o)) if ["*", "/", "%"].contains(o) => *o,
                _ => return Ok(left),
            };
            self.at += 1;
            left = Expr::Binary(op, Box::new(left), Box::new(self.unary()?));
        }
    }

    fn unary(&mut self) -> Result<Expr> {
        if self.eat("!") {
            return Ok(Expr::Unary("!", Box::new(self.unary()?)));
        }
        if self.eat("-") {
            return Ok(Expr::Unary("-", Box::new(self.unary()?)));
        }
        self.member()
    }

    fn args(&mut self, close: &str) -> Result<Vec<Expr>> {
        let mut args = Vec::new();
        if self.eat(close) {
            return Ok(args);
        }
        loop {
            args.push(self.expr()?);
            if self.eat(close) {
                return Ok(args);
            }
            self.expect(",")?;
        }
    }

    fn member(&mut self) -> Result<Expr> {
        let mut e = self.primary()?;
        loop {
            if self.eat(".") {
                let Some(Token::Ident(name)) = self.peek().cloned() else {
                    return unsupported(
                        "syntax this evaluator does not parse: a name must follow '.'",
                    );
                };
                self.at += 1;
                if self.eat("(") {
                    let args = self.args(")")?;
                    e = Expr::Call {
                        target: Some(Box::new(e)),
                        name,
                        args,
                    };
                } else {
                    e = Expr::Member(Box::new(e), name);
                }
            } else if self.eat("[") {
                let index = self.expr()?;
                self.expect("]")?;
                e = Expr::Index(Box::new(e), Box::new(index));
            } else {
                return Ok(e);
            }
        }
    }

    fn primary(&mut self) -> Result<Expr> {
        let token = self.peek().cloned().ok_or_else(|| {
            Error::Unsupported("syntax this evaluator does not parse: unexpected end".into())
        })?;
        self.at += 1;
        Ok(match token {
            Token::Int(i) => Expr::Literal(Value::Int(i)),
            Token::Double(d) => Expr::Literal(Value::Double(d)),
            Token::Str(s) => Expr::Literal(Value::String(s)),
            Token::Ident(i) => match i.as_str() {
                "true" => Expr::Literal(Value::Bool(true)),
                "false" => Expr::Literal(Value::Bool(false)),
                "null" => Expr::Literal(Value::Null),
                _ if self.eat("(") => Expr::Call {
                    target: None,
                    name: i,
                    args: self.args(")")?,
                },
                _ => Expr::Ident(i),
            },
            Token::Op("(") => {
                let e = self.expr()?;
                self.expect(")")?;
                e
            }
            Token::Op("[") => Expr::List(self.args("]")?),
            Token::Op(o) => {
                return unsupported(format!(
                    "syntax this evaluator does not parse: unexpected {o:?}"
                ));
            }
        })
    }
}

/// Parses `src`. The API server compiled every stored selector, so what does not parse here is
/// syntax outside the subset: unsupported, never a verdict on the device.
pub fn parse(src: &str) -> Result<Expr> {
    let mut p = Parser {
        tokens: tokens(src)?,
        at: 0,
    };
    let e = p.expr()?;
    if p.at != p.tokens.len() {
        return unsupported(format!(
            "syntax this evaluator does not parse: unexpected {:?}",
            p.tokens[p.at]
        ));
    }
    Ok(e)
}

/// A device as the scheduler's CEL environment sees it: `device.driver`, and the attributes and
/// capacity by domain.
#[derive(Clone, Debug, Default)]
pub struct Device {
    pub driver: String,
    /// domain -> name -> value
    pub attributes: BTreeMap<String, BTreeMap<String, Value>>,
    /// domain -> name -> quantity
    pub capacity: BTreeMap<String, BTreeMap<String, Quantity>>,
}

impl Device {
    fn value(&self) -> Value {
        let attributes = self
            .attributes
            .iter()
            .map(|(d, m)| (d.clone(), Value::Map(m.clone())))
            .collect();
        let capacity = self
            .capacity
            .iter()
            .map(|(d, m)| {
                let m = m
                    .iter()
                    .map(|(k, q)| (k.clone(), Value::Quantity(q.clone())))
                    .collect();
                (d.clone(), Value::Map(m))
            })
            .collect();
        Value::Map(BTreeMap::from([
            ("driver".to_owned(), Value::String(self.driver.clone())),
            ("attributes".to_owned(), Value::Domains(attributes)),
            ("capacity".to_owned(), Value::Domains(capacity)),
        ]))
    }
}

/// Evaluates `expr` for `device`: `Ok(true)` when the device is selected.
pub fn evaluate(expr: &Expr, device: &Device) -> Result<bool> {
    match eval(expr, &device.value())? {
        Value::Bool(b) => Ok(b),
        other => runtime(format!(
            "the expression is a {}, not a bool",
            other.type_name()
        )),
    }
}

/// The device facts an expression reads (`device.attributes["d"].name`,
/// `device.capacity["d"].name`, `device.driver`): (the path as written, the device's value or
/// `None` when it has none), so a finding can say what the device has.
pub fn reads(expr: &Expr, device: &Device) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    walk(expr, &mut |e| {
        let found = match e {
            Expr::Member(inner, name) => match inner.as_ref() {
                Expr::Ident(d) if d == "device" && name == "driver" => Some((
                    "device.driver".to_owned(),
                    Some(format!("{:?}", device.driver)),
                )),
                Expr::Index(base, domain) => match (base.as_ref(), domain.as_ref()) {
                    (Expr::Member(dev, which), Expr::Literal(Value::String(domain))) if matches!(dev.as_ref(), Expr::Ident(d) if d == "device") =>
                    {
                        let value = match which.as_str() {
                            "attributes" => device
                                .attributes
                                .get(domain)
                                .and_then(|m| m.get(name))
                                .map(ToString::to_string),
                            "capacity" => device
                                .capacity
                                .get(domain)
                                .and_then(|m| m.get(name))
                                .map(|q| q.text.clone()),
                            _ => return,
                        };
                        Some((format!("{which}[{domain:?}].{name}"), value))
                    }
                    _ => None,
                },
                _ => None,
            },
            _ => None,
        };
        if let Some(f) = found
            && !out.contains(&f)
        {
            out.push(f);
        }
    });
    out
}

fn walk(e: &Expr, f: &mut impl FnMut(&Expr)) {
    f(e);
    match e {
        Expr::Literal(_) | Expr::Ident(_) => {}
        Expr::List(items) => items.iter().for_each(|i| walk(i, f)),
        Expr::Member(inner, _) | Expr::Unary(_, inner) => walk(inner, f),
        Expr::Index(a, b) | Expr::Binary(_, a, b) => {
            walk(a, f);
            walk(b, f);
        }
        Expr::Call { target, args, .. } => {
            if let Some(t) = target {
                walk(t, f);
            }
            args.iter().for_each(|a| walk(a, f));
        }
        Expr::Conditional(a, b, c) => {
            walk(a, f);
            walk(b, f);
            walk(c, f);
        }
    }
}

fn select(base: Value, key: &str) -> Result<Value> {
    match base {
        Value::Map(m) => m
            .get(key)
            .cloned()
            .map_or_else(|| runtime(format!("no such key: {key}")), Ok),
        Value::Domains(m) => Ok(m.get(key).cloned().unwrap_or_default()),
        other => runtime(format!(
            "no such key: {key} (on a {}, not a map)",
            other.type_name()
        )),
    }
}

impl Default for Value {
    fn default() -> Self {
        Value::Map(BTreeMap::new())
    }
}

fn eval(e: &Expr, device: &Value) -> Result<Value> {
    match e {
        Expr::Literal(v) => Ok(v.clone()),
        Expr::Ident(i) if i == "device" => Ok(device.clone()),
        Expr::Ident(i) => runtime(format!("undeclared reference to {i:?}")),
        Expr::List(items) => Ok(Value::List(
            items
                .iter()
                .map(|i| eval(i, device))
                .collect::<Result<_>>()?,
        )),
        Expr::Member(inner, name) => select(eval(inner, device)?, name),
        Expr::Index(inner, index) => {
            let base = eval(inner, device)?;
            match (base, eval(index, device)?) {
                (base @ (Value::Map(_) | Value::Domains(_)), Value::String(k)) => select(base, &k),
                (Value::List(l), Value::Int(i)) => usize::try_from(i)
                    .ok()
                    .and_then(|i| l.get(i).cloned())
                    .map_or_else(|| runtime(format!("index out of range: {i}")), Ok),
                (b, i) => runtime(format!(
                    "no such overload: {}[{}]",
                    b.type_name(),
                    i.type_name()
                )),
            }
        }
        Expr::Unary(op, inner) => match (*op, eval(inner, device)?) {
            ("!", Value::Bool(b)) => Ok(Value::Bool(!b)),
            ("-", Value::Int(i)) => i
                .checked_neg()
                .map(Value::Int)
                .ok_or_else(|| Error::Runtime("int overflow".into())),
            ("-", Value::Double(d)) => Ok(Value::Double(-d)),
            (op, v) => runtime(format!("no such overload: {op}{}", v.type_name())),
        },
        Expr::Binary("&&", a, b) => logic(eval(a, device), || eval(b, device), false),
        Expr::Binary("||", a, b) => logic(eval(a, device), || eval(b, device), true),
        Expr::Binary(op, a, b) => binary(op, eval(a, device)?, eval(b, device)?),
        Expr::Conditional(c, a, b) => match eval(c, device)? {
            Value::Bool(true) => eval(a, device),
            Value::Bool(false) => eval(b, device),
            v => runtime(format!("no such overload: {} ? :", v.type_name())),
        },
        Expr::Call { target, name, args } => call(target.as_deref(), name, args, device),
    }
}

/// `&&` (`absorbing` false) and `||` (`absorbing` true) as CEL defines them: the absorbing
/// value on either side wins even over an error on the other.
fn logic(a: Result<Value>, b: impl FnOnce() -> Result<Value>, absorbing: bool) -> Result<Value> {
    let as_bool = |r: Result<Value>| match r {
        Ok(Value::Bool(x)) => Ok(x),
        Ok(v) => runtime(format!("no such overload: logic on {}", v.type_name())),
        Err(e) => Err(e),
    };
    let a = as_bool(a);
    if a == Ok(absorbing) {
        return Ok(Value::Bool(absorbing));
    }
    let b = as_bool(b());
    if b == Ok(absorbing) {
        return Ok(Value::Bool(absorbing));
    }
    a?;
    b?;
    Ok(Value::Bool(!absorbing))
}

fn compare(a: &Value, b: &Value) -> Result<Ordering> {
    let o = match (a, b) {
        (Value::Int(x), Value::Int(y)) => Some(x.cmp(y)),
        (Value::Double(x), Value::Double(y)) => x.partial_cmp(y),
        #[allow(clippy::cast_precision_loss)]
        (Value::Int(x), Value::Double(y)) => (*x as f64).partial_cmp(y),
        #[allow(clippy::cast_precision_loss)]
        (Value::Double(x), Value::Int(y)) => x.partial_cmp(&(*y as f64)),
        (Value::String(x), Value::String(y)) => Some(x.cmp(y)),
        (Value::Bool(x), Value::Bool(y)) => Some(x.cmp(y)),
        _ => None,
    };
    o.ok_or_else(|| {
        Error::Runtime(format!(
            "no such overload: {} compared with {}",
            a.type_name(),
            b.type_name()
        ))
    })
}

fn equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Int(_) | Value::Double(_), Value::Int(_) | Value::Double(_)) => {
            compare(a, b) == Ok(Ordering::Equal)
        }
        (Value::Domains(x), Value::Map(y)) | (Value::Map(x), Value::Domains(y)) => x == y,
        _ => a == b,
    }
}

fn binary(op: &str, a: Value, b: Value) -> Result<Value> {
    Ok(match op {
        "==" => Value::Bool(equal(&a, &b)),
        "!=" => Value::Bool(!equal(&a, &b)),
        "<" => Value::Bool(compare(&a, &b)? == Ordering::Less),
        "<=" => Value::Bool(compare(&a, &b)? != Ordering::Greater),
        ">" => Value::Bool(compare(&a, &b)? == Ordering::Greater),
        ">=" => Value::Bool(compare(&a, &b)? != Ordering::Less),
        "in" => match b {
            Value::List(l) => Value::Bool(l.iter().any(|x| equal(x, &a))),
            Value::Map(m) | Value::Domains(m) => match a {
                Value::String(k) => Value::Bool(m.contains_key(&k)),
                other => return runtime(format!("no such overload: {} in map", other.type_name())),
            },
            other => return runtime(format!("no such overload: in {}", other.type_name())),
        },
        "+" => match (a, b) {
            (Value::String(x), Value::String(y)) => Value::String(x + &y),
            (Value::List(mut x), Value::List(y)) => {
                x.extend(y);
                Value::List(x)
            }
            (a, b) => arithmetic(op, &a, &b)?,
        },
        _ => arithmetic(op, &a, &b)?,
    })
}

fn arithmetic(op: &str, a: &Value, b: &Value) -> Result<Value> {
    match (a, b) {
        (Value::Int(x), Value::Int(y)) => {
            let r = match op {
                "+" => x.checked_add(*y),
                "-" => x.checked_sub(*y),
                "*" => x.checked_mul(*y),
                "/" if *y == 0 => return runtime("division by zero"),
                "/" => x.checked_div(*y),
                "%" if *y == 0 => return runtime("modulus by zero"),
                "%" => x.checked_rem(*y),
                _ => return unsupported(format!("the operator {op}")),
            };
            r.map(Value::Int)
                .ok_or_else(|| Error::Runtime("int overflow".into()))
        }
        (Value::Double(x), Value::Double(y)) => Ok(Value::Double(match op {
            "+" => x + y,
            "-" => x - y,
            "*" => x * y,
            "/" => x / y,
            _ => return runtime(format!("no such overload: double {op} double")),
        })),
        _ => runtime(format!(
            "no such overload: {} {op} {}",
            a.type_name(),
            b.type_name()
        )),
    }
}

fn string_arg(name: &str, args: &[Value]) -> Result<String> {
    match args {
        [Value::String(s)] => Ok(s.clone()),
        _ => runtime(format!("no such overload: {name} takes one string")),
    }
}

fn quantity_arg(name: &str, args: &[Value]) -> Result<i128> {
    match args {
        [Value::Quantity(q)] => Ok(q.nanos),
        [Value::Int(i)] if name == "add" || name == "sub" => Ok(i128::from(*i) * 1_000_000_000),
        _ => runtime(format!("no such overload: Quantity.{name}")),
    }
}

fn ordering(o: Ordering) -> Value {
    Value::Int(match o {
        Ordering::Less => -1,
        Ordering::Equal => 0,
        Ordering::Greater => 1,
    })
}

fn call(target: Option<&Expr>, name: &str, args: &[Expr], device: &Value) -> Result<Value> {
    if target.is_none() && name == "has" {
        let [Expr::Member(inner, field)] = args else {
            return runtime("has() takes one field selection");
        };
        return Ok(Value::Bool(match eval(inner, device)? {
            Value::Map(m) | Value::Domains(m) => m.contains_key(field),
            v => return runtime(format!("has() on a {}", v.type_name())),
        }));
    }
    if ["all", "exists", "exists_one", "map", "filter"].contains(&name) {
        return unsupported(format!("the {name}() macro"));
    }
    let args: Vec<Value> = args
        .iter()
        .map(|a| eval(a, device))
        .collect::<Result<_>>()?;
    let Some(target) = target else {
        return match name {
            "quantity" => {
                let s = string_arg(name, &args)?;
                Quantity::parse(&s)
                    .map(Value::Quantity)
                    .ok_or_else(|| Error::Runtime(format!("quantity({s:?}): not a quantity")))
            }
            "isQuantity" => Ok(Value::Bool(
                Quantity::parse(&string_arg(name, &args)?).is_some(),
            )),
            "semver" => {
                let s = match args.as_slice() {
                    [Value::String(s)] => s.clone(),
                    _ => return unsupported("semver() with a normalize argument"),
                };
                Version::parse(&s)
                    .map(Value::Version)
                    .ok_or_else(|| Error::Runtime(format!("semver({s:?}): not a semver")))
            }
            "isSemver" => Ok(Value::Bool(
                Version::parse(&string_arg(name, &args)?).is_some(),
            )),
            "size" => size(args.first()),
            _ => unsupported(format!("the function {name}()")),
        };
    };
    let target = eval(target, device)?;
    match (target, name) {
        (Value::Quantity(q), "compareTo") => Ok(ordering(q.nanos.cmp(&quantity_arg(name, &args)?))),
        (Value::Quantity(q), "isGreaterThan") => {
            Ok(Value::Bool(q.nanos > quantity_arg(name, &args)?))
        }
        (Value::Quantity(q), "isLessThan") => Ok(Value::Bool(q.nanos < quantity_arg(name, &args)?)),
        (Value::Quantity(q), "sign") => Ok(Value::Int(match q.nanos.cmp(&0) {
            Ordering::Less => -1,
            Ordering::Equal => 0,
            Ordering::Greater => 1,
        })),
        (Value::Quantity(q), "isInteger") => Ok(Value::Bool(q.nanos % 1_000_000_000 == 0)),
        (Value::Quantity(q), "asInteger") => {
            if q.nanos % 1_000_000_000 != 0 {
                return runtime(format!("{}.asInteger(): not an integer", q.text));
            }
            i64::try_from(q.nanos / 1_000_000_000)
                .map(Value::Int)
                .map_err(|_| Error::Runtime(format!("{}.asInteger(): overflow", q.text)))
        }
        #[allow(clippy::cast_precision_loss)]
        (Value::Quantity(q), "asApproximateFloat") => {
            Ok(Value::Double(q.nanos as f64 / 1_000_000_000.0))
        }
        (Value::Quantity(q), "add") => Ok(Value::Quantity(Quantity::from_nanos(
            q.nanos + quantity_arg(name, &args)?,
        ))),
        (Value::Quantity(q), "sub") => Ok(Value::Quantity(Quantity::from_nanos(
            q.nanos - quantity_arg(name, &args)?,
        ))),
        (Value::Version(v), "compareTo" | "isGreaterThan" | "isLessThan") => {
            let [Value::Version(w)] = args.as_slice() else {
                return runtime(format!("no such overload: Semver.{name}"));
            };
            let o = v.cmp(w);
            Ok(match name {
                "compareTo" => ordering(o),
                "isGreaterThan" => Value::Bool(o == Ordering::Greater),
                _ => Value::Bool(o == Ordering::Less),
            })
        }
        (Value::Version(v), "major") => Ok(Value::Int(i64::try_from(v.major).unwrap_or(i64::MAX))),
        (Value::Version(v), "minor") => Ok(Value::Int(i64::try_from(v.minor).unwrap_or(i64::MAX))),
        (Value::Version(v), "patch") => Ok(Value::Int(i64::try_from(v.patch).unwrap_or(i64::MAX))),
        (Value::String(s), "startsWith") => {
            Ok(Value::Bool(s.starts_with(&string_arg(name, &args)?)))
        }
        (Value::String(s), "endsWith") => Ok(Value::Bool(s.ends_with(&string_arg(name, &args)?))),
        (Value::String(s), "contains") => Ok(Value::Bool(s.contains(&string_arg(name, &args)?))),
        (Value::String(s), "lowerAscii") => Ok(Value::String(s.to_ascii_lowercase())),
        (Value::String(s), "upperAscii") => Ok(Value::String(s.to_ascii_uppercase())),
        (Value::String(_), "matches") => unsupported("regular expressions (matches())"),
        (v, "size") => size(Some(&v)),
        (v, _) => unsupported(format!("the method {}.{name}()", v.type_name())),
    }
}

fn size(v: Option<&Value>) -> Result<Value> {
    let n = match v {
        Some(Value::String(s)) => s.chars().count(),
        Some(Value::List(l)) => l.len(),
        Some(Value::Map(m) | Value::Domains(m)) => m.len(),
        Some(v) => return runtime(format!("no such overload: size({})", v.type_name())),
        None => return runtime("size() takes one argument"),
    };
    Ok(Value::Int(i64::try_from(n).unwrap_or(i64::MAX)))
}

#[cfg(test)]
#[path = "cel_tests.rs"]
mod tests;
