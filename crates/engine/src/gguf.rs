//! GGUF v3 reader over an mmap, zero-copy (MODEL.md §1.1, §1.4). Knows no model.
//!
//! The parser treats the file as hostile: every read is bounds-checked, every count and length is
//! capped against the bytes that remain *before* anything is allocated, array nesting is capped,
//! and the tensor table is checked (n_dims 1..=4, nonzero dims, no element-count overflow, unique
//! names and keys, aligned offsets inside the data section, no overlaps, `ne0` a whole number of
//! blocks). Type id 42 (Q2_0) is resolved per file from the tensor extents (§1.4) before anything
//! can read tensor data. Unknown type ids are tolerated here (`qtype == None`); the model
//! validation in `config.rs` refuses them on the tensors it needs.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use bonsai_kernels_cpu::quant::{dequantize_row, GGML_TYPE_Q2_0};
use bonsai_kernels_cpu::QuantType;
use memmap2::Mmap;

use crate::error::{Error, Result};

/// Magic bytes at the start of every GGUF file.
pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";
/// The only container version this reader accepts.
pub const GGUF_VERSION: u32 = 3;
/// Alignment of the data section and every tensor offset when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Largest accepted `general.alignment`.
pub const MAX_ALIGNMENT: u64 = 1 << 20;
/// Deepest accepted nesting of metadata arrays (an array of arrays is depth 2).
pub const MAX_ARRAY_DEPTH: usize = 4;
/// Most metadata values (array elements included) one file may hold. A real Bonsai header holds
/// about 750 k (tokens, merges, token types); the cap bounds memory for hostile input.
pub const MAX_METADATA_VALUES: usize = 1 << 23;
/// Longest accepted tensor name in bytes (ggml's own limit is 64).
pub const MAX_TENSOR_NAME: usize = 256;
/// Most dimensions a tensor may have.
pub const MAX_DIMS: usize = 4;

/// Smallest possible encoded sizes, used to cap counts against the remaining bytes.
const MIN_KV_BYTES: u64 = 8 + 4 + 1; // key length, value type, 1-byte value
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8; // name length, n_dims, one dim, type, offset

// GGUF metadata value type ids.
const VT_U8: u32 = 0;
const VT_I8: u32 = 1;
const VT_U16: u32 = 2;
const VT_I16: u32 = 3;
const VT_U32: u32 = 4;
const VT_I32: u32 = 5;
const VT_F32: u32 = 6;
const VT_BOOL: u32 = 7;
const VT_STRING: u32 = 8;
const VT_ARRAY: u32 = 9;
const VT_U64: u32 = 10;
const VT_I64: u32 = 11;
const VT_F64: u32 = 12;

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// The value as an unsigned integer, for any integer variant that is non-negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, for any integer variant that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::U8(v) => Some(v as i64),
            Value::U16(v) => Some(v as i64),
            Value::U32(v) => Some(v as i64),
            Value::U64(v) => i64::try_from(v).ok(),
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => None,
        }
    }

    /// The value as a float, for float variants and integers.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self
                .as_i64()
                .map(|v| v as f64)
                .or_else(|| self.as_u64().map(|v| v as f64)),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The GGUF type name, used in error messages ("expected u32, found string").
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::F32(_) => "f32",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F64(_) => "f64",
        }
    }

    /// The GGUF value type id of this value.
    pub fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => VT_U8,
            Value::I8(_) => VT_I8,
            Value::U16(_) => VT_U16,
            Value::I16(_) => VT_I16,
            Value::U32(_) => VT_U32,
            Value::I32(_) => VT_I32,
            Value::F32(_) => VT_F32,
            Value::Bool(_) => VT_BOOL,
            Value::String(_) => VT_STRING,
            Value::Array(_) => VT_ARRAY,
            Value::U64(_) => VT_U64,
            Value::I64(_) => VT_I64,
            Value::F64(_) => VT_F64,
        }
    }
}

impl fmt::Display for Value {
    /// Short human form; long arrays are abbreviated.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::String(s) => {
                if s.chars().count() > 60 {
                    let head: String = s.chars().take(57).collect();
                    write!(f, "{head:?}... ({} bytes)", s.len())
                } else {
                    write!(f, "{s:?}")
                }
            }
            Value::Array(a) => {
                write!(f, "[")?;
                for (i, v) in a.iter().take(8).enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "{v}")?;
                }
                if a.len() > 8 {
                    write!(f, ", ... ({} items)", a.len())?;
                }
                write!(f, "]")
            }
        }
    }
}

/// One entry of the tensor table, with its storage type resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` = `ne0`, the contiguous axis.
    pub dims: Vec<u64>,
    /// The ggml type id as stored in the file.
    pub ggml_type: u32,
    /// Resolved type (id 42 resolved per file); `None` = unknown id (tolerated until used).
    pub qtype: Option<QuantType>,
    /// Byte offset relative to the data section start.
    pub offset: u64,
    /// Resolved byte size (0 if the type is unknown).
    pub n_bytes: usize,
    /// Bytes from `offset` to the next tensor's offset, or to the end of the data section.
    pub extent: u64,
}

impl TensorInfo {
    /// Product of all dims (checked against overflow at parse).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// The contiguous axis length.
    pub fn ne0(&self) -> usize {
        self.dims[0] as usize
    }
    /// Product of `dims[1..]` (1 for a 1-D tensor).
    pub fn n_rows(&self) -> usize {
        self.dims[1..].iter().product::<u64>() as usize
    }
    /// Bytes of one row (`ne0` elements), if the type is known.
    pub fn row_bytes(&self) -> Option<usize> {
        self.qtype.and_then(|q| q.row_bytes(self.ne0()))
    }
    /// The type as a display name ("Q1_0", or "type#143" for an unknown id).
    pub fn type_name(&self) -> String {
        match self.qtype {
            Some(q) => q.name().to_string(),
            None => format!("type#{}", self.ggml_type),
        }
    }
}

enum Backing {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A parsed, container-validated GGUF file. The bytes are shared (`Arc`), so tensor slices are
/// zero-copy views into the mmap.
pub struct Gguf {
    backing: Arc<Backing>,
    version: u32,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    data_start: u64,
    alignment: u64,
}

impl fmt::Debug for Gguf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.version)
            .field("file_len", &self.file_len())
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .field("data_start", &self.data_start)
            .field("alignment", &self.alignment)
            .finish()
    }
}

impl Gguf {
    /// Memory-map and parse `path`. An unreadable file is `Error::Io` naming the path; a malformed
    /// container is `Error::Format` (prefixed with the path).
    pub fn open(path: &Path) -> Result<Gguf> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(Error::Format(format!(
                "{}: not a regular file (a directory or a device); expected a .gguf file",
                path.display()
            )));
        }
        let len = meta.len();
        let backing = if len == 0 {
            Backing::Owned(Vec::new())
        } else {
            // SAFETY: the file is opened read-only and the map is never written through. Like every
            // mmap-based loader we rely on the file not being truncated or modified while mapped;
            // that is the documented contract of `Gguf::open`.
            let map = unsafe { Mmap::map(&file) }.map_err(io)?;
            Backing::Mmap(map)
        };
        Gguf::parse(Arc::new(backing)).map_err(|e| match e {
            Error::Format(m) => Error::Format(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// The matrix `name` (ggml `[n_in, n_out]`), checked: present, that shape, a known type whose
    /// blocks tile `n_in`, and exactly the bytes that implies. Returns its index in
    /// [`tensors`](Self::tensors), its type and its bytes. Every backend loads matrices through this.
    pub fn matrix(
        &self,
        name: &str,
        n_in: usize,
        n_out: usize,
    ) -> Result<(usize, QuantType, &[u8])> {
        let idx = self
            .tensors()
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| Error::tensor(name, "missing"))?;
        let t = &self.tensors()[idx];
        if t.ne0() != n_in || t.n_rows() != n_out {
            return Err(Error::tensor(
                name,
                format!("expected shape [{n_in}, {n_out}], found {:?}", t.dims),
            ));
        }
        let qt = t
            .qtype
            .ok_or_else(|| Error::tensor(name, format!("unknown type id {}", t.ggml_type)))?;
        let data = self.tensor_data(t)?;
        let need = qt.row_bytes(n_in).ok_or_else(|| {
            Error::tensor(
                name,
                format!("ne0 {n_in} is not a multiple of {}", qt.block_elems()),
            )
        })? * n_out;
        if data.len() != need {
            return Err(Error::tensor(
                name,
                format!("expected {need} bytes, found {}", data.len()),
            ));
        }
        Ok((idx, qt, data))
    }

    /// The small tensor `name` as f32, checked: exactly `n` elements, all finite. Every backend
    /// loads its norm / gate / conv vectors through this.
    pub fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        let v = self.tensor_f32(name)?;
        if v.len() != n {
            return Err(Error::tensor(
                name,
                format!("expected {n} elements, found {}", v.len()),
            ));
        }
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(Error::tensor(
                name,
                format!("non-finite value at element {i}"),
            ));
        }
        Ok(v)
    }

    /// Parse an owned buffer with the same parser (tests, fuzzing).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Gguf> {
        Gguf::parse(Arc::new(Backing::Owned(bytes)))
    }

    pub fn version(&self) -> u32 {
        self.version
    }
    pub fn alignment(&self) -> u64 {
        self.alignment
    }
    /// Absolute byte offset of the data section.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }
    pub fn file_len(&self) -> u64 {
        self.backing.bytes().len() as u64
    }
    /// Bytes of the data section (`file_len - data_start`, 0 if the file ends before it).
    pub fn data_len(&self) -> u64 {
        self.file_len().saturating_sub(self.data_start)
    }
    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.backing.bytes()
    }

    /// Read `data` (a slice of [`Self::bytes`], e.g. a tensor's) into the page cache and map its
    /// pages now (`madvise(MADV_POPULATE_READ)`, Linux ≥ 5.14; elsewhere, or if the kernel refuses
    /// it, `MADV_WILLNEED`, which starts the reads without waiting). For tensors read a row at a
    /// time from the map while decoding (the drafter's host embedding): on a cold page cache each
    /// new row would otherwise be a disk read inside the timed draft (+2–3 ms a draft measured on
    /// the H200 machine after dropping the page cache). A slice outside the map, an empty one or an
    /// owned buffer changes nothing; the bytes never change.
    pub fn prefault(&self, data: &[u8]) {
        #[cfg(unix)]
        if let Backing::Mmap(m) = &*self.backing {
            let base = m.as_ptr() as usize;
            let start = data.as_ptr() as usize;
            let Some(off) = start.checked_sub(base) else {
                return;
            };
            if off.checked_add(data.len()).is_none_or(|e| e > m.len()) || data.is_empty() {
                return;
            }
            // align the start down to 64 KiB, a multiple of every page size in use (madvise needs
            // a page-aligned start; the map itself starts on a page)
            let a = off / (1 << 16) * (1 << 16);
            let len = off + data.len() - a;
            #[cfg(target_os = "linux")]
            if m.advise_range(memmap2::Advice::PopulateRead, a, len)
                .is_ok()
            {
                return;
            }
            let _ = m.advise_range(memmap2::Advice::WillNeed, a, len);
        }
        #[cfg(not(unix))]
        let _ = data;
    }

    /// Drop the pages of `data` (a slice of [`Self::bytes`]) from this process's map
    /// (`madvise(MADV_DONTNEED)` on the whole 64 KiB-aligned pages inside it): for tensors a backend
    /// has copied into its own layout, so the map's copy stops counting towards the resident set.
    /// A later read of `data` faults the same file bytes back in. A slice outside the map or an
    /// owned buffer changes nothing.
    pub fn release(&self, data: &[u8]) {
        #[cfg(unix)]
        if let Backing::Mmap(m) = &*self.backing {
            let base = m.as_ptr() as usize;
            let Some(off) = (data.as_ptr() as usize).checked_sub(base) else {
                return;
            };
            let Some(end) = off.checked_add(data.len()).filter(|&e| e <= m.len()) else {
                return;
            };
            const P: usize = 1 << 16; // a multiple of every page size in use
            let (a, b) = (off.div_ceil(P) * P, end / P * P);
            if b > a {
                // SAFETY: the map is a read-only mapping of a file this process never writes, so
                // MADV_DONTNEED only drops page-table entries: the next access faults in the same
                // bytes from the page cache or the file, and every live borrow of the map keeps
                // reading what it read before. [a, b) lies inside the map (checked above).
                let _ = unsafe {
                    m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, a, b - a)
                };
            }
        }
        #[cfg(not(unix))]
        let _ = data;
    }

    /// All metadata pairs in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| Error::metadata(key, "missing"))
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| type_err(key, "string", v))
    }

    /// Any integer type whose value fits in u32.
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        let v = self.require(key)?;
        let x = v
            .as_u64()
            .ok_or_else(|| type_err(key, "an unsigned integer", v))?;
        u32::try_from(x).map_err(|_| Error::metadata(key, format!("value {x} does not fit in u32")))
    }

    /// Any non-negative integer.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| type_err(key, "an unsigned integer", v))
    }

    /// f32 or f64 (narrowed), or an integer.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        let v = self.require(key)?;
        v.as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| type_err(key, "a float", v))
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| type_err(key, "bool", v))
    }

    pub fn get_array(&self, key: &str) -> Result<&[Value]> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| type_err(key, "array", v))
    }

    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        self.get_array(key)?
            .iter()
            .enumerate()
            .map(|(i, v)| v.as_str().ok_or_else(|| elem_err(key, i, "string", v)))
            .collect()
    }

    /// Elements of any integer type that fit in i32.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>> {
        self.get_array(key)?
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_i64()
                    .and_then(|x| i32::try_from(x).ok())
                    .ok_or_else(|| elem_err(key, i, "an integer fitting i32", v))
            })
            .collect()
    }

    /// Elements of any integer type that fit in u32.
    pub fn get_u32_array(&self, key: &str) -> Result<Vec<u32>> {
        self.get_array(key)?
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(|| elem_err(key, i, "an integer fitting u32", v))
            })
            .collect()
    }

    /// All tensors in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor's bytes: exactly `n_bytes`, zero-copy. Errors if the type is unknown.
    pub fn tensor_data(&self, t: &TensorInfo) -> Result<&[u8]> {
        if t.qtype.is_none() {
            return Err(Error::tensor(
                &t.name,
                format!("unknown ggml type id {}", t.ggml_type),
            ));
        }
        // Offsets and sizes were checked at parse; checked arithmetic keeps this panic-free even
        // for a TensorInfo that did not come from this file.
        let start = self
            .data_start
            .checked_add(t.offset)
            .and_then(|s| usize::try_from(s).ok());
        let range = start.and_then(|s| s.checked_add(t.n_bytes).map(|e| s..e));
        range
            .and_then(|r| self.bytes().get(r))
            .ok_or_else(|| Error::tensor(&t.name, "data range lies outside the file"))
    }

    /// Dequantized f32 copy of a tensor of any known type (meant for small tensors).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self
            .tensor(name)
            .ok_or_else(|| Error::tensor(name, "missing"))?;
        let src = self.tensor_data(t)?;
        let qt = t.qtype.expect("tensor_data checked the type");
        // `ne0` is a whole number of blocks (checked at parse), so the whole tensor is too.
        let mut out = vec![0f32; t.n_elements() as usize];
        dequantize_row(qt, src, &mut out);
        Ok(out)
    }

    fn parse(backing: Arc<Backing>) -> Result<Gguf> {
        let bytes = backing.bytes();
        let file_len = bytes.len() as u64;
        let mut c = Cursor { b: bytes, pos: 0 };

        // 1. Header.
        let magic = c.take(4, "magic")?;
        if magic != GGUF_MAGIC {
            return Err(Error::format(format!(
                "bad magic {:02x?} at offset 0, expected \"GGUF\" (47 47 55 46)",
                magic
            )));
        }
        let version = c.u32("version")?;
        if version != GGUF_VERSION {
            return Err(Error::format(format!(
                "unsupported GGUF version {version}, expected {GGUF_VERSION}"
            )));
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        let rem = c.remaining() as u64;
        if n_tensors > rem / MIN_TENSOR_INFO_BYTES {
            return Err(Error::format(format!(
                "absurd tensor count {n_tensors}: needs at least {} bytes of tensor infos, \
                 only {rem} bytes follow the header (file truncated?)",
                n_tensors.saturating_mul(MIN_TENSOR_INFO_BYTES)
            )));
        }
        if n_kv > rem / MIN_KV_BYTES {
            return Err(Error::format(format!(
                "absurd metadata count {n_kv}: needs at least {} bytes, only {rem} bytes follow \
                 the header",
                n_kv.saturating_mul(MIN_KV_BYTES)
            )));
        }

        // 2. Metadata.
        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut key_index = HashMap::with_capacity(n_kv as usize);
        let mut budget = MAX_METADATA_VALUES;
        for i in 0..n_kv {
            let at = c.pos;
            let key = c.string("metadata key")?;
            if key.is_empty() {
                return Err(Error::format(format!(
                    "metadata key #{i} at offset {at} is empty"
                )));
            }
            let vt = c.u32("value type")?;
            let value = read_value(&mut c, vt, key, 1, &mut budget)?;
            if key_index.insert(key.to_string(), metadata.len()).is_some() {
                return Err(Error::format(format!(
                    "duplicate metadata key '{key}' at offset {at}"
                )));
            }
            metadata.push((key.to_string(), value));
        }

        // 3. Alignment.
        let alignment = match key_index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(Value::U32(a)) => {
                let a = *a as u64;
                if a == 0 || !a.is_power_of_two() || a > MAX_ALIGNMENT {
                    return Err(Error::metadata(
                        "general.alignment",
                        format!("must be a power of two in 1..={MAX_ALIGNMENT}, found {a}"),
                    ));
                }
                a
            }
            Some(v) => return Err(type_err("general.alignment", "u32", v)),
        };

        // 4. Tensor infos.
        let rem = c.remaining() as u64;
        if n_tensors > rem / MIN_TENSOR_INFO_BYTES {
            return Err(Error::format(format!(
                "absurd tensor count {n_tensors}: needs at least {} bytes of tensor infos, \
                 only {rem} bytes follow the metadata (offset {})",
                n_tensors.saturating_mul(MIN_TENSOR_INFO_BYTES),
                c.pos
            )));
        }
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut tensor_index = HashMap::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let at = c.pos;
            let name = c.string("tensor name")?;
            if name.is_empty() || name.len() > MAX_TENSOR_NAME {
                return Err(Error::format(format!(
                    "tensor #{i} at offset {at}: name length {} not in 1..={MAX_TENSOR_NAME}",
                    name.len()
                )));
            }
            let n_dims = c.u32("tensor n_dims")?;
            if n_dims == 0 || n_dims as usize > MAX_DIMS {
                return Err(Error::format(format!(
                    "tensor '{name}': n_dims {n_dims} not in 1..={MAX_DIMS} (offset {at})"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            let mut n_elem: u64 = 1;
            for d in 0..n_dims {
                let ne = c.u64("tensor dim")?;
                if ne == 0 {
                    return Err(Error::format(format!("tensor '{name}': dim {d} is zero")));
                }
                n_elem = n_elem
                    .checked_mul(ne)
                    .filter(|&n| n <= i64::MAX as u64)
                    .ok_or_else(|| {
                        Error::format(format!(
                            "tensor '{name}': element count overflows ({dims:?} x {ne})"
                        ))
                    })?;
                dims.push(ne);
            }
            let ggml_type = c.u32("tensor type")?;
            let offset = c.u64("tensor offset")?;
            let qtype = QuantType::from_ggml_unambiguous(ggml_type);
            if tensor_index
                .insert(name.to_string(), tensors.len())
                .is_some()
            {
                return Err(Error::format(format!(
                    "duplicate tensor name '{name}' (offset {at})"
                )));
            }
            tensors.push(TensorInfo {
                name: name.to_string(),
                dims,
                ggml_type,
                qtype,
                offset,
                n_bytes: 0,
                extent: 0,
            });
        }

        // 5. Data section.
        let data_start = round_up(c.pos as u64, alignment);
        if !tensors.is_empty() && data_start > file_len {
            return Err(Error::format(format!(
                "file ends at {file_len}, before the data section at offset {data_start}"
            )));
        }
        let data_len = file_len.saturating_sub(data_start);

        // 6. Offsets: aligned, inside the data section; extents from the sorted table.
        for t in &tensors {
            if t.offset % alignment != 0 {
                return Err(Error::format(format!(
                    "tensor '{}': offset {} is not a multiple of the alignment {alignment}",
                    t.name, t.offset
                )));
            }
            if t.offset >= data_len {
                return Err(Error::format(format!(
                    "tensor '{}': offset {} (absolute {}) is past the end of the data section \
                     ({data_len} bytes)",
                    t.name,
                    t.offset,
                    data_start.saturating_add(t.offset)
                )));
            }
        }
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_by_key(|&i| tensors[i].offset);
        for w in order.windows(2) {
            let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
            if a.offset == b.offset {
                return Err(Error::format(format!(
                    "tensors '{}' and '{}' overlap: both start at offset {}",
                    a.name, b.name, a.offset
                )));
            }
        }
        for (k, &i) in order.iter().enumerate() {
            let end = order.get(k + 1).map_or(data_len, |&j| tensors[j].offset);
            tensors[i].extent = end - tensors[i].offset;
        }

        // 7. Byte sizes of the unambiguous types; block divisibility of ne0.
        for t in tensors.iter_mut() {
            if let Some(q) = t.qtype {
                t.n_bytes = tensor_bytes(q, &t.name, &t.dims)?;
            } else if t.ggml_type == GGML_TYPE_Q2_0 && t.dims[0] % 64 != 0 {
                return Err(Error::format(format!(
                    "tensor '{}': ne0 {} is not a multiple of the Q2_0 block size (64 or 128)",
                    t.name, t.dims[0]
                )));
            }
        }

        // 8. id-42 resolution (MODEL.md §1.4).
        if let Some(q) = resolve_q2_0(&tensors, alignment)? {
            for t in tensors.iter_mut().filter(|t| t.ggml_type == GGML_TYPE_Q2_0) {
                t.qtype = Some(q);
                t.n_bytes = tensor_bytes(q, &t.name, &t.dims)?;
            }
        }

        // 9. Every known-type tensor fits its extent (no overlap, nothing past the end).
        for (k, &i) in order.iter().enumerate() {
            let t = &tensors[i];
            if t.qtype.is_some() && (t.n_bytes as u64) > t.extent {
                let end = t.offset.saturating_add(t.n_bytes as u64);
                return Err(match order.get(k + 1) {
                    Some(&j) => Error::format(format!(
                        "tensor '{}' ({} bytes at offset {}, ends at {end}) overlaps tensor '{}' \
                         at offset {}",
                        t.name, t.n_bytes, t.offset, tensors[j].name, tensors[j].offset
                    )),
                    None => Error::format(format!(
                        "tensor '{}' ({} bytes at offset {}) ends at {end}, past the end of the \
                         data section ({data_len} bytes; file truncated?)",
                        t.name, t.n_bytes, t.offset
                    )),
                });
            }
        }

        Ok(Gguf {
            backing,
            version,
            metadata,
            key_index,
            tensors,
            tensor_index,
            data_start,
            alignment,
        })
    }
}

/// Resolve id 42 for one file: `Some(G128 | G64)`, or `None` when no tensor uses id 42.
fn resolve_q2_0(tensors: &[TensorInfo], alignment: u64) -> Result<Option<QuantType>> {
    let cands = [QuantType::Q2_0G128, QuantType::Q2_0G64];
    // Candidates still possible for every id-42 tensor seen so far, and who decided it.
    let mut possible = [true, true];
    let mut decided_by: [Option<&str>; 2] = [None, None];
    let mut any = false;
    for t in tensors.iter().filter(|t| t.ggml_type == GGML_TYPE_Q2_0) {
        any = true;
        let n = t.n_elements();
        let sizes = cands.map(|q| {
            (t.dims[0] % q.block_elems() as u64 == 0)
                .then(|| (n / q.block_elems() as u64) * q.block_bytes() as u64)
        });
        let fits = sizes.map(|s| s.is_some_and(|s| s <= t.extent && t.extent < s + alignment));
        let show =
            |s: Option<u64>| s.map_or("n/a (ne0 not a multiple of 128)".into(), |s| s.to_string());
        if !fits[0] && !fits[1] {
            return Err(Error::tensor(
                &t.name,
                format!(
                    "type 42 (Q2_0) fits neither block layout: g128 needs {} bytes, g64 needs {} \
                     bytes, but its extent is {} bytes (alignment {alignment})",
                    show(sizes[0]),
                    show(sizes[1]),
                    t.extent
                ),
            ));
        }
        for k in 0..2 {
            if !fits[k] && possible[k] {
                possible[k] = false;
                decided_by[1 - k] = Some(&t.name);
            }
        }
        if !possible[0] && !possible[1] {
            // This tensor fits exactly one layout; an earlier tensor excluded it.
            let (this, other) = if fits[0] { (0, 1) } else { (1, 0) };
            let label = ["g128", "g64"];
            return Err(Error::tensor(
                &t.name,
                format!(
                    "type 42 (Q2_0) tensors disagree on the block layout: '{}' is {} but this \
                     tensor is {} (g128 {} bytes, g64 {} bytes, extent {} bytes)",
                    decided_by[other].unwrap_or("?"),
                    label[other],
                    label[this],
                    show(sizes[0]),
                    show(sizes[1]),
                    t.extent
                ),
            ));
        }
    }
    if !any {
        return Ok(None);
    }
    match possible {
        [true, false] => Ok(Some(QuantType::Q2_0G128)),
        [false, true] => Ok(Some(QuantType::Q2_0G64)),
        _ => Err(Error::format(
            "type 42 (Q2_0) block layout is ambiguous: every id-42 tensor fits both g128 and g64 \
             within the alignment padding",
        )),
    }
}

/// Byte size of a tensor of a known type; errors if `ne0` is not a whole number of blocks.
fn tensor_bytes(q: QuantType, name: &str, dims: &[u64]) -> Result<usize> {
    let be = q.block_elems() as u64;
    if dims[0] % be != 0 {
        return Err(Error::format(format!(
            "tensor '{name}': ne0 {} is not a multiple of the {} block size {be}",
            dims[0],
            q.name()
        )));
    }
    let rows: u64 = dims[1..].iter().product();
    (dims[0] / be)
        .checked_mul(q.block_bytes() as u64)
        .and_then(|r| r.checked_mul(rows))
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| Error::format(format!("tensor '{name}': byte size overflows")))
}

fn round_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a).saturating_mul(a)
}

fn type_err(key: &str, expected: &str, found: &Value) -> Error {
    Error::metadata(
        key,
        format!("expected {expected}, found {}", found.type_name()),
    )
}

fn elem_err(key: &str, i: usize, expected: &str, found: &Value) -> Error {
    Error::metadata(
        key,
        format!(
            "element {i}: expected {expected}, found {} ({found})",
            found.type_name()
        ),
    )
}

/// Smallest encoded size of one value of type `vt` (for capping array counts).
fn min_value_bytes(vt: u32) -> Option<u64> {
    Some(match vt {
        VT_U8 | VT_I8 | VT_BOOL => 1,
        VT_U16 | VT_I16 => 2,
        VT_U32 | VT_I32 | VT_F32 => 4,
        VT_U64 | VT_I64 | VT_F64 | VT_STRING => 8,
        VT_ARRAY => 12,
        _ => return None,
    })
}

fn read_value(
    c: &mut Cursor<'_>,
    vt: u32,
    key: &str,
    depth: usize,
    budget: &mut usize,
) -> Result<Value> {
    if *budget == 0 {
        return Err(Error::format(format!(
            "metadata key '{key}': more than {MAX_METADATA_VALUES} metadata values in the file"
        )));
    }
    *budget -= 1;
    let at = c.pos;
    Ok(match vt {
        VT_U8 => Value::U8(c.take(1, key)?[0]),
        VT_I8 => Value::I8(c.take(1, key)?[0] as i8),
        VT_U16 => Value::U16(u16::from_le_bytes(c.arr(key)?)),
        VT_I16 => Value::I16(i16::from_le_bytes(c.arr(key)?)),
        VT_U32 => Value::U32(c.u32(key)?),
        VT_I32 => Value::I32(i32::from_le_bytes(c.arr(key)?)),
        VT_F32 => Value::F32(f32::from_le_bytes(c.arr(key)?)),
        VT_U64 => Value::U64(c.u64(key)?),
        VT_I64 => Value::I64(i64::from_le_bytes(c.arr(key)?)),
        VT_F64 => Value::F64(f64::from_le_bytes(c.arr(key)?)),
        VT_BOOL => match c.take(1, key)?[0] {
            0 => Value::Bool(false),
            1 => Value::Bool(true),
            b => {
                return Err(Error::format(format!(
                    "metadata key '{key}': bool byte {b} at offset {at} is not 0 or 1"
                )))
            }
        },
        VT_STRING => Value::String(c.string(key)?.to_string()),
        VT_ARRAY => {
            if depth > MAX_ARRAY_DEPTH {
                return Err(Error::format(format!(
                    "metadata key '{key}': arrays nested deeper than {MAX_ARRAY_DEPTH} (offset {at})"
                )));
            }
            let et = c.u32(key)?;
            let min = min_value_bytes(et).ok_or_else(|| {
                Error::format(format!(
                    "metadata key '{key}': unknown array element type {et} at offset {at}"
                ))
            })?;
            let count = c.u64(key)?;
            let rem = c.remaining() as u64;
            if count > rem / min {
                return Err(Error::format(format!(
                    "metadata key '{key}': absurd array count {count} at offset {at}: needs at \
                     least {} bytes, only {rem} remain",
                    count.saturating_mul(min)
                )));
            }
            if count as usize > *budget {
                return Err(Error::format(format!(
                    "metadata key '{key}': array of {count} values exceeds the limit of \
                     {MAX_METADATA_VALUES} metadata values"
                )));
            }
            let mut items = Vec::with_capacity(count as usize);
            for _ in 0..count {
                items.push(read_value(c, et, key, depth + 1, budget)?);
            }
            Value::Array(items)
        }
        other => {
            return Err(Error::format(format!(
                "metadata key '{key}': unknown value type {other} at offset {}",
                at.saturating_sub(4)
            )))
        }
    })
}

/// Bounds-checked little-endian reader.
struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.b.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(Error::format(format!(
                "truncated: {what} needs {n} bytes at offset {}, but the file has {} bytes",
                self.pos,
                self.b.len()
            )));
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }

    /// A length-prefixed UTF-8 string; the length is checked against the remaining bytes first.
    fn string(&mut self, what: &str) -> Result<&'a str> {
        let at = self.pos;
        let len = self.u64(what)?;
        let rem = self.remaining() as u64;
        if len > rem {
            return Err(Error::format(format!(
                "{what}: absurd string length {len} at offset {at}, only {rem} bytes remain"
            )));
        }
        let s = self.take(len as usize, what)?;
        std::str::from_utf8(s)
            .map_err(|e| Error::format(format!("{what}: string at offset {at} is not UTF-8 ({e})")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_conversions() {
        assert_eq!(Value::I32(-1).as_u64(), None);
        assert_eq!(Value::I32(7).as_u64(), Some(7));
        assert_eq!(Value::U64(u64::MAX).as_i64(), None);
        assert_eq!(Value::F32(1.5).as_f64(), Some(1.5));
        assert_eq!(Value::U8(3).as_f64(), Some(3.0));
        assert_eq!(Value::String("x".into()).as_str(), Some("x"));
        assert_eq!(Value::Bool(true).type_name(), "bool");
    }

    #[test]
    fn gguf_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Gguf>();
    }

    #[test]
    fn round_up_works() {
        assert_eq!(round_up(0, 32), 0);
        assert_eq!(round_up(1, 32), 32);
        assert_eq!(round_up(64, 32), 64);
    }
}
