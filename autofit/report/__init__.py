"""What a study is turned into: tables, the result object, pictures, the HTML page and the exports to trainers."""
