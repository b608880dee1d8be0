//! Replaces each `-- @include <name>` line of `lua/*.lua` with `lua/include/<name>.lua` (what
//! follows its first blank line) and writes the result to `$OUT_DIR/lua/`, where the scripts
//! are compiled from: a block several scripts share is written once (a script sent to Redis
//! cannot `require` another).

use std::path::Path;

fn main() {
    println!("cargo:rerun-if-changed=lua");
    let out = Path::new(&std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("lua");
    std::fs::create_dir_all(&out).expect("create $OUT_DIR/lua");
    for entry in std::fs::read_dir("lua").expect("read lua/") {
        let path = entry.expect("a lua/ entry").path();
        if path.extension().is_none_or(|e| e != "lua") {
            continue;
        }
        let text = read(&path);
        let mut expanded = String::with_capacity(text.len());
        for line in text.lines() {
            match line.strip_prefix("-- @include ") {
                Some(name) => {
                    let file = read(&Path::new("lua/include").join(format!("{}.lua", name.trim())));
                    // What comes before the first blank line says who includes it; not sent.
                    let block = file.split_once("\n\n").map_or(file.as_str(), |(_, b)| b);
                    expanded.push_str(block.trim_end_matches('\n'));
                }
                None => expanded.push_str(line),
            }
            expanded.push('\n');
        }
        let target = out.join(path.file_name().expect("a file name"));
        std::fs::write(&target, expanded)
            .unwrap_or_else(|e| panic!("write {}: {e}", target.display()));
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}
